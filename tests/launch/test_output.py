"""What a user sees from `tfdist launch`: one progress display, no TensorFlow logs, no escape
codes on a pipe, a live bar on a terminal (tfdist/launch/output.py).

The relay's rules run on small Python programs that write what Keras and TensorFlow write
(fast, exact); the README's multi-worker command and a user's tutorial-style script run for
real, on a pipe and on a pseudo-terminal. A terminal is checked by replaying the bytes it
received (`_screen`): what stays on screen, and what was shown while a bar was live.
"""

import fcntl
import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time

import pytest

from tests.support import REPO
from tfdist import chief
from tfdist.launch import launch, output

PY = sys.executable
BAR = "━"

# What Keras's progress bar writes (keras/src/utils/progbar.py: "\b" * previous width, "\r",
# bold step count, green/white bar) and what TensorFlow logs.
_FAKE = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
STEPS, PAUSE = int(sys.argv[1]), float(sys.argv[2])
err = sys.stderr
print("W0000 00:00:1795456104.971374   22509 some_op.cc:12] a C++ warning", file=err)
print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
      file=err)
print("I0000 00:00:1795655624.662676    6368 grpc_server_lib.cc:467] Started server", file=err)
print("I1126 01:13:46.234037 140601371077504 cross_device_ops.py:1154] Collective all_reduce "
      "tensors: 1 all_reduces", file=err, flush=True)
print(f"hello from {name}", flush=True)
for epoch in (1, 2):
    print(f"Epoch {epoch}/2", flush=True)
    width = 0
    for step in range(1, STEPS + 1):
        bar = (f"\\x1b[1m{step}/{STEPS}\\x1b[0m \\x1b[32m{'━' * step}\\x1b[0m"
               f"\\x1b[37m{'━' * (STEPS - step)}\\x1b[0m - loss: {1 / step:.4f}")
        sys.stdout.write("\\b" * width + "\\r" + bar + ("\\n" if step == STEPS else ""))
        sys.stdout.flush()
        width = len(bar)
        if name == "worker:1" and step == 2:
            print("W1126 01:13:46.5 1401 foo.py:1] careful", file=err, flush=True)
        time.sleep(PAUSE)
if name == "worker:1":
    print("Traceback (most recent call last):", file=err)
    print("ValueError: worker 1 reports an error", file=err, flush=True)
print(f"{name} done", flush=True)
"""


def _lines(text: str, task: str) -> list[str]:
    return [line.removeprefix(f"[{task}] ") for line in text.splitlines()
            if line.startswith(f"[{task}] ")]


def _fake(tmp_path) -> str:
    path = tmp_path / "fake_keras.py"
    path.write_text(_FAKE)
    return str(path)


def _launch(tmp_path, steps=3, pause=0.0, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    result = launch([PY, _fake(tmp_path), str(steps), str(pause)], num_workers=2, stdout=out,
                    stderr=err, **kwargs)
    assert result.ok, err.getvalue()
    return out.getvalue(), err.getvalue()


def _bar(step: int, steps: int) -> str:
    return f"{step}/{steps} {BAR * steps} - loss: {1 / step:.4f}"


@pytest.mark.timeout(60)
def test_two_workers_on_a_pipe_one_plain_progress_display(tmp_path):
    out, err = _launch(tmp_path)
    assert "\x1b" not in out + err and "\r" not in out + err and "\b" not in out + err
    # The main task: its lines and one plain line per epoch (the bar's final state).
    assert _lines(out, "worker:0") == [
        "hello from worker:0", "Epoch 1/2", _bar(3, 3), "Epoch 2/2", _bar(3, 3),
        "worker:0 done"]
    # Worker 1: no progress, its other lines, warnings and errors with its prefix.
    assert _lines(out, "worker:1") == ["hello from worker:1", "worker:1 done"]
    assert _lines(err, "worker:1") == [
        "W0000 00:00:1795456104.971374   22509 some_op.cc:12] a C++ warning",
        "W1126 01:13:46.5 1401 foo.py:1] careful", "W1126 01:13:46.5 1401 foo.py:1] careful",
        "Traceback (most recent call last):", "ValueError: worker 1 reports an error"]
    # TensorFlow's start-up line and INFO records (C++ and Python) are hidden.
    assert "InitializeLog" not in err and "grpc_server_lib" not in err
    assert "Collective all_reduce" not in err

    # Negative controls: --verbosity=1 keeps TensorFlow's logs; --output=all every line.
    _, err = _launch(tmp_path, tf_logs=True)
    assert "Collective all_reduce" in err and "grpc_server_lib" in err and "InitializeLog" in err
    out, err = _launch(tmp_path, output="all")
    assert _lines(out, "worker:1") == [
        "hello from worker:1", "Epoch 1/2", _bar(3, 3), "Epoch 2/2", _bar(3, 3),
        "worker:1 done"]
    assert "Collective all_reduce" in err and "\x1b" not in out


@pytest.mark.timeout(60)
def test_a_line_rewritten_in_place_keeps_only_its_latest_state(tmp_path):
    """200,000 carriage-return updates (3.6 MB) without a newline: one line, not 55 pieces."""
    script = tmp_path / "spinner.py"
    script.write_text(textwrap.dedent("""
        import sys
        for i in range(200_000):
            sys.stdout.write(f"\\rstep {i:>10}")
        sys.stdout.write("\\n")
    """))
    out = io.StringIO()
    result = launch([PY, str(script)], num_workers=1, stdout=out, stderr=io.StringIO())
    assert result.ok
    assert out.getvalue() == "[worker:0] step     199999\n"


def _screen(raw: str, width: int = 200) -> list[str]:
    """The screen lines a terminal `width` columns wide shows after receiving `raw`."""
    lines, col = [[]], 0
    for ch in output.strip_escapes(raw):
        if ch == "\n":
            lines.append([])
            col = 0
        elif ch == "\r":
            col = 0
        elif ch == "\b":
            col = max(0, col - 1)
        else:
            if col >= width:  # the terminal wraps: "\r" then only reaches this new line
                lines.append([])
                col = 0
            line = lines[-1]
            line[col:col + 1] = [ch]
            col += 1
    return ["".join(line).rstrip() for line in lines]


def test_console_redraws_its_live_line_around_other_lines():
    terminal = io.StringIO()
    console = output.Console(out=terminal, err=terminal, live=True)
    console.progress("[worker:0] 1/3 ━━━━━━━━━━ - loss: 1.0000", owner="w0")
    console.line("err", "[worker:1] short")  # shorter than the bar: no remnant may stay
    console.progress("[worker:0] 2/3 ━━━━━━━━━━ - loss: 0.5000", owner="w0")
    assert _screen(terminal.getvalue()) == [
        "[worker:1] short", "[worker:0] 2/3 ━━━━━━━━━━ - loss: 0.5000"]
    console.line("out", "[worker:0] 3/3 ━━━━━━━━━━ - loss: 0.3333", owner="w0")
    console.line("out", "[worker:0] done")
    assert _screen(terminal.getvalue()) == [
        "[worker:1] short", "[worker:0] 3/3 ━━━━━━━━━━ - loss: 0.3333", "[worker:0] done", ""]


def _terminal(width: int):
    """A pseudo-terminal `width` columns wide: (master fd, slave fd)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, width, 0, 0))
    return master, slave


def _read_all(master: int, proc, timeout: float) -> list[str]:
    """Everything the terminal received, as the chunks it arrived in."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data.decode("utf-8", "replace"))
    return chunks


def test_live_line_is_cut_to_the_terminal_width():
    master, slave = _terminal(width=40)
    try:
        sink = os.fdopen(os.dup(slave), "w", encoding="utf-8")
        console = output.Console(out=sink, err=sink)
        assert console.live  # a terminal
        console.progress("\x1b[1m[worker:0] 1/3\x1b[0m " + BAR * 60 + " - loss: 1.0", owner=1)
        sink.close()
        raw = os.read(master, 65536).decode()
    finally:
        os.close(master)
        os.close(slave)
    # 39 visible characters: one screen line, so the next "\r" redraws it in place.
    assert _screen(raw, width=40) == ["[worker:0] 1/3 " + BAR * 24]
    assert raw.endswith("\x1b[0m")  # the cut does not leave the terminal bold or coloured


def _launch_on_a_terminal(argv, *, width=160, timeout=240, env=None):
    master, slave = _terminal(width)
    proc = subprocess.Popen([PY, "-m", "tfdist.launch", *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave,
                            env=dict(os.environ, PYTHONPATH=REPO, **(env or {})))
    os.close(slave)
    try:
        chunks = _read_all(master, proc, timeout)
        assert proc.wait(timeout=60) == 0, "".join(chunks)[-3000:]
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    # What the screen showed after each chunk: its last line is the live one, if any.
    shown = [_screen("".join(chunks[:i + 1]), width) for i in range(len(chunks))]
    return "".join(chunks), shown


@pytest.mark.timeout(60)
def test_two_workers_on_a_terminal_one_live_bar(tmp_path):
    raw, shown = _launch_on_a_terminal(["--num_workers=2", "--", PY, _fake(tmp_path), "4", "0.3"])
    screen = _screen(raw, 160)
    assert f"[worker:0] {_bar(4, 4)}" in screen and screen.count("[worker:0] Epoch 1/2") == 1
    # While worker 0 trained, the screen's last line was its bar at an earlier step.
    live = {lines[-1] for lines in shown}
    assert {f"[worker:0] {_bar(s, 4)}" for s in (1, 2, 3)} & live, live
    # Nothing else of the bars stays: no earlier step, no worker 1 progress; worker 1's warnings
    # and errors are whole lines with its prefix.
    assert not [line for line in screen if "/4 " in line and _bar(4, 4) not in line], screen
    assert screen.count("[worker:1] W1126 01:13:46.5 1401 foo.py:1] careful") == 2
    assert "[worker:1] ValueError: worker 1 reports an error" in screen
    assert "\x1b[32m" in raw  # Keras's colours stay on a terminal


def test_fit_verbose_progress_from_one_task():
    worker = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                       "task": {"type": "worker", "index": 1}})}
    main = {"TF_CONFIG": worker["TF_CONFIG"].replace('"index": 1', '"index": 0')}
    to_file, to_terminal = io.StringIO(), _Terminal()
    assert chief.fit_verbose({}, stream=to_terminal) == "auto"  # one process, a terminal
    assert chief.fit_verbose({}, stream=to_file) == 2  # a log file: one line per epoch
    assert chief.fit_verbose(main, stream=to_file) == 2  # srun, Ray: the main task writes
    assert chief.fit_verbose(worker, stream=to_terminal) == 0  # the others do not
    # Under tfdist launch the launcher draws the bar (and hides the other tasks' progress).
    assert chief.fit_verbose({**main, chief.OUTPUT_ENV: "main"}, stream=to_file) == "auto"
    assert chief.fit_verbose({**worker, chief.OUTPUT_ENV: "main"}, stream=to_file) == 0
    assert chief.fit_verbose({**worker, chief.OUTPUT_ENV: "all"}, stream=to_file) == "auto"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _tf_log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if output.STARTUP_LINES.match(line.split("] ", 1)[-1])
            or output.INFO_LINES.match(line.split("] ", 1)[-1])]


@pytest.mark.timeout(300)
def test_readme_multi_worker_command_on_a_pipe(tmp_path):
    metrics = tmp_path / "metrics.json"
    result = subprocess.run(
        [PY, "-m", "tfdist.cli", "launch", "--num_workers=2", "--timeout=250", "--", "python",
         "-m", "experiments.train", "--strategy=multi_worker_mirrored", "--epochs=2",
         "--steps_per_epoch=3", f"--metrics_out={metrics}"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    out, err = result.stdout, result.stderr
    assert "\x1b" not in out + err and "\r" not in out + err
    assert not _tf_log_lines(out + err), _tf_log_lines(out + err)
    assert all(line.startswith("[tfdist launch] ") for line in err.splitlines()), err
    # 7 lines from the chief, nothing from worker 1, 2-3 from the launcher: 10-11 lines
    # (before: 63 with --epochs=3, 40 of them TensorFlow's logs, both workers' bars).
    assert all(line.startswith("[worker:0] ") for line in out.splitlines()), out
    lines = _lines(out, "worker:0")
    assert lines[0] == ("tfdist: MultiWorkerMirroredStrategy: 2 replica(s) on 2 workers (worker:0 "
                        "here: /job:worker/replica:0/task:0/device:CPU:0); global batch 64 = 2 x "
                        "32 per replica")
    assert lines[1].startswith("tfdist: mlp on digits: ")
    assert [line.split(" ━")[0] for line in lines[2:6]] == ["Epoch 1/2", "3/3", "Epoch 2/2", "3/3"]
    assert lines[6].startswith("tfdist: held-out accuracy ") and len(lines) == 7
    assert json.loads(metrics.read_text())["strategy"] == "MultiWorkerMirroredStrategy"


@pytest.mark.timeout(300)
def test_users_script_on_a_terminal(tmp_path):
    """A tutorial-style script (TensorFlow imported first, default `fit` on every worker)."""
    script = os.path.join(REPO, "tests", "launch", "run_keras_fit.py")
    raw, shown = _launch_on_a_terminal(["--num_workers=2", "--timeout=250", "--", "python",
                                        script])
    screen = [line for line in _screen(raw, 160) if line]
    # One bar per epoch, the chief's, its final state kept; drawn live while it ran.
    bars = [line for line in screen if "/3 ━" in line]
    assert [line.split(" ━")[0] for line in bars] == ["[worker:0] 3/3"] * 2, screen
    assert {lines[-1].split(" ━")[0] for lines in shown} & {"[worker:0] 1/3", "[worker:0] 2/3"}
    assert screen.count("[worker:0] Epoch 1/2") == 1 and "[worker:1] Epoch 1/2" not in screen
    # Worker 1's warning and both workers' own lines; no TensorFlow log line.
    assert any(line.startswith("[worker:1] ") and "UserWarning: worker 1 warns" in line
               for line in screen), screen
    assert "[worker:0] worker:0 done" in screen and "[worker:1] worker:1 done" in screen
    assert not _tf_log_lines("\n".join(screen)), _tf_log_lines("\n".join(screen))
