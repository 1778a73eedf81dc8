"""`python -m tfdist.launch ...`: the same flags as `tfdist launch`."""

import sys

from tfdist.cli import run

if __name__ == "__main__":
    run(["tfdist", "launch", *sys.argv[1:]], prog="python -m tfdist.launch")
