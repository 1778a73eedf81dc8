"""`python -m tfdist.launch ...`: the same flags as `tfdist launch`."""

from tfdist.cli import run

if __name__ == "__main__":
    run(["tfdist", "launch", *__import__("sys").argv[1:]], prog="python -m tfdist.launch")
