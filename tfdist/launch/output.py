"""The tasks' output: one reader thread for every pipe, whole lines, bounded memory.

Every line a task writes is copied to our stdout or stderr with the task's name
in front (`[worker:1] ...`). What the relay adds:
- **bounded memory**: a line longer than `MAX_LINE` bytes (a child writing
  without newlines) is passed on in pieces of that size, each marked, instead
  of growing a buffer without limit;
- **TensorFlow's start-up lines** (oneDNN notice, CPU feature guard, CUDA
  probing: about 6 per process, printed before a script can silence them when
  it imports TensorFlow before tfdist) are dropped unless asked for;
- **activity**: the time of each task's last output, for the progress timeout;
- the last lines of each task, for the launcher's closing message;
- a reader that never blocks a task: when our own stdout goes away (a closed
  pipe, `tfdist launch ... | head`) the relay keeps draining the tasks' pipes.
"""

from __future__ import annotations

import collections
import os
import re
import selectors
import threading
import time
from typing import IO

MAX_LINE = 64 * 1024
_CHUNK = 64 * 1024
_CUT = " [tfdist launch: line longer than 65536 bytes, continued on the next line]"

# glog ("I0000 00:00:1795456104.971374   22509 ") or the older TF format
# ("2024-01-01 12:00:00.123456: I tensorflow/core/util/").
_GLOG = r"(?:[IWEF]\d{4} [\d:.]+\s+\d+ |\d{4}-\d\d-\d\d [\d:.]+: [IWEF] \S*?)"
STARTUP_LINES = re.compile("|".join([
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"To enable the following instructions: .* rebuild TensorFlow with the appropriate "
    r"compiler flags\.$",
    _GLOG + r"port\.cc:\d+\] oneDNN custom operations are on\.",
    _GLOG + r"cudart_stub\.cc:\d+\] (?:Could not find cuda drivers|Ignore above cudart dlerror)",
    _GLOG + r"cpu_feature_guard\.cc:\d+\] (?:This TensorFlow binary is optimized|Your CPU "
    r"supports instructions)",
    _GLOG + r"cuda_platform\.cc:\d+\] failed call to cuInit",
    _GLOG + r"cuda_diagnostics\.cc:\d+\] ",
    _GLOG + r"cuda_(?:dnn|fft|blas)\.cc:\d+\] Unable to register cu\w+ factory",
    _GLOG + r"computation_placer\.cc:\d+\] computation placer already registered",
    _GLOG + r"dso_loader\.cc:\d+\] Could not load dynamic library",
    r".*py_utils\.cc:\d+\] TF-TRT Warning: Could not find TensorRT",
]))


class TaskOutput:
    """What the relay knows about one task's output."""

    def __init__(self, name: str, tail_lines: int = 20):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.last_output = time.monotonic()
        self.dropped_startup_lines = 0
        self.open_pipes = 0


class Relay:
    """Copies the tasks' pipes to two sinks with a prefix, from one thread.

    Args:
      out, err: where the tasks' stdout and stderr lines go.
      lock: serialises writes to the sinks (shared with the launcher's messages).
      startup_logs: keep TensorFlow's start-up lines.
    """

    def __init__(self, *, out: IO[str], err: IO[str], lock: threading.Lock,
                 startup_logs: bool = False):
        self._sinks = {"out": out, "err": err}
        self._broken: set[str] = set()
        self._lock = lock
        self._startup_logs = startup_logs
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[tuple[int, TaskOutput, str, IO[bytes]]] = []
        self._pending_lock = threading.Lock()
        self._closing = False
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tfdist-launch-relay", daemon=True)
        self._thread.start()

    def add(self, task: TaskOutput, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Starts relaying a task's two pipes (the relay closes them at EOF)."""
        with self._pending_lock:
            for pipe, kind in ((stdout, "out"), (stderr, "err")):
                fd = pipe.fileno()
                os.set_blocking(fd, False)
                task.open_pipes += 1
                self._pending.append((fd, task, kind, pipe))
        os.write(self._wake_w, b"x")

    def wait_closed(self, task: TaskOutput, timeout: float) -> bool:
        """Waits until both of a task's pipes reached EOF (its output is complete)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while task.open_pipes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _emit(self, task: TaskOutput, kind: str, raw: bytes, cut: bool = False) -> None:
        line = raw.decode("utf-8", "replace")
        if line.endswith("\r"):
            line = line[:-1]
        if kind == "err" and not self._startup_logs and STARTUP_LINES.match(line):
            task.dropped_startup_lines += 1
            return
        task.tail.append(line)
        if kind in self._broken:
            return
        sink = self._sinks[kind]
        with self._lock:
            try:
                sink.write(f"[{task.name}] {line}{_CUT if cut else ''}\n")
                sink.flush()
            except (BrokenPipeError, ValueError, OSError):
                # Our reader went away: keep draining the tasks, write nothing more.
                self._broken.add(kind)

    def _run(self) -> None:
        buffers: dict[int, bytearray] = {}
        while True:
            with self._pending_lock:
                for fd, task, kind, pipe in self._pending:
                    self._selector.register(fd, selectors.EVENT_READ, (task, kind, pipe))
                    buffers[fd] = bytearray()
                self._pending.clear()
                if self._closing and len(self._selector.get_map()) == 1:
                    return
            for key, _ in self._selector.select(timeout=0.5):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                task, kind, pipe = key.data
                fd = key.fd
                try:
                    chunk = os.read(fd, _CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                buf = buffers[fd]
                if chunk:
                    task.last_output = time.monotonic()
                    buf += chunk
                    *lines, rest = buf.split(b"\n")
                    for line in lines:
                        self._emit_long(task, kind, line)
                    buf[:] = rest
                    while len(buf) > MAX_LINE:
                        self._emit(task, kind, bytes(buf[:MAX_LINE]), cut=True)
                        del buf[:MAX_LINE]
                    continue
                if buf:
                    self._emit_long(task, kind, bytes(buf))
                del buffers[fd]
                self._selector.unregister(fd)
                pipe.close()
                with self._idle:
                    task.open_pipes -= 1
                    self._idle.notify_all()

    def _emit_long(self, task: TaskOutput, kind: str, line: bytes) -> None:
        while len(line) > MAX_LINE:
            self._emit(task, kind, line[:MAX_LINE], cut=True)
            line = line[MAX_LINE:]
        self._emit(task, kind, line)

    def close(self, timeout: float = 10) -> None:
        """Stops once every pipe added so far reached EOF (or after `timeout` s)."""
        self._closing = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
