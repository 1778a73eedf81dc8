"""The tasks' output: one reader thread for every pipe, rendered for the person reading it.

Every line a task writes is copied to our stdout or stderr with the task's name
in front (`[worker:1] ...`). What the relay does on the way (`Display`):
- **one progress display**: a line a task rewrites in place (Keras's progress
  bar, tqdm: `\\r` and `\\b` updates) is shown for the *main* task only (the
  chief, else worker 0), as a live bar when our stdout is a terminal (or a
  notebook) and as one plain line, its final state, otherwise; other tasks'
  progress (and Keras's `Epoch N/M` headers and `verbose=2` lines) is hidden;
- **no escape codes on a pipe**: colour and cursor codes are removed from every
  line when our stdout is not a terminal;
- **TensorFlow's logs hidden**: its start-up lines (oneDNN notice, CPU feature
  guard, CUDA probing, printed before a script can silence them) and every
  INFO-level log record (C++ or Python: `I0000 ... grpc_server_lib.cc]`,
  `I1126 ... cross_device_ops.py:1154] Collective all_reduce ...`) are dropped;
  warnings, errors and tracebacks always pass;
- `show="all"` (`tfdist launch --output=all`) hides nothing: every line of
  every task, other tasks' progress as plain lines, TensorFlow's logs too;
- **bounded memory**: a line longer than `MAX_LINE` bytes (a child writing
  without newlines) is passed on in pieces of that size, each marked; a line
  rewritten in place keeps only its latest state;
- **activity**: the time of each task's last output, for the progress timeout;
- the last lines of each task (shown or not), for the launcher's messages;
- a reader that never blocks a task: when our own stdout goes away (a closed
  pipe, `tfdist launch ... | head`) the relay keeps draining the tasks' pipes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import selectors
import sys
import threading
import time
from typing import IO, Literal

MAX_LINE = 64 * 1024
_CHUNK = 64 * 1024
_CUT = " [tfdist launch: line longer than 65536 bytes, continued on the next line]"

Show = Literal["main", "all"]
SHOW = ("main", "all")

# glog ("I0000 00:00:1795456104.971374   22509 "), absl's Python handler
# ("I1126 01:13:45.752707 140601371077504 ") or the older TF format
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
# INFO-level records: glog/absl (`I0000 ...`, `I1126 ...`), the older TF
# format, Python's default format for TensorFlow's and absl's loggers, and
# absl's note before its flags are parsed.
INFO_LINES = re.compile("|".join([
    r"I\d{4} [\d:.]+\s+\d+ \S+:\d+\] ",
    r"\d{4}-\d\d-\d\d [\d:.]+: I \S+:\d+\] ",
    r"INFO:(?:tensorflow|absl):",
    r"WARNING: Logging before flag parsing goes to stderr\.$",
]))
# Progress that is not rewritten in place: Keras's epoch header and its
# `verbose=2` line ("22/22 - 1s - 10ms/step - loss: ...").
PROGRESS_LINES = re.compile(r"Epoch \d+/\d+$|\s*\d+/(?:\d+|Unknown) - ")
# Terminal control sequences (colours, cursor moves, erase) and OSC titles.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_escapes(text: str) -> str:
    """`text` without terminal control sequences."""
    return _ESCAPES.sub("", text)


def main_task(*, chief: bool) -> str:
    """The task whose progress is shown: 'chief:0' in a job with a chief, else 'worker:0'."""
    return "chief:0" if chief else "worker:0"


def check_show(show) -> None:
    if show not in SHOW:
        raise ValueError(f"output must be one of {', '.join(repr(s) for s in SHOW)}. "
                         f"Received: output={show!r}. 'main' shows one progress display and "
                         f"hides TensorFlow's logs; 'all' shows everything from every task.")


@dataclasses.dataclass(frozen=True)
class Display:
    """What the relay shows.

    Attributes:
      main_task: the task whose progress is shown ('chief:0' / 'worker:0');
        None: no task on this machine is the main one.
      show: "main" (one progress display, TensorFlow's logs hidden) or "all"
        (every line of every task).
      tf_logs: keep TensorFlow's start-up lines and INFO log records
        (implied by show="all").
    """

    main_task: str | None = "worker:0"
    show: Show = "main"
    tf_logs: bool = False

    def __post_init__(self):
        check_show(self.show)

    @property
    def keeps_tf_logs(self) -> bool:
        return self.tf_logs or self.show == "all"


def _visible_width(text: str) -> int:
    return len(strip_escapes(text))


def _fit(text: str, width: int) -> str:
    """`text` cut to `width` visible characters, its escape codes kept (colours reset)."""
    if _visible_width(text) <= width:
        return text
    kept, seen, pos = [], 0, 0
    for match in _ESCAPES.finditer(text):
        plain = text[pos:match.start()]
        if seen + len(plain) >= width:
            kept.append(plain[:width - seen])
            return "".join(kept) + "\x1b[0m"
        kept.append(plain)
        seen += len(plain)
        kept.append(match.group())
        pos = match.end()
    kept.append(text[pos:][:width - seen])
    return "".join(kept) + "\x1b[0m"


class Console:
    """The launcher's two sinks: whole lines, and at most one live progress line.

    On a terminal (or in a notebook) a progress line is redrawn in place; any
    other line first clears it and then draws it again below. Elsewhere there
    is no live line and escape codes are removed.

    Args:
      out, err: where stdout and stderr lines go.
      live: draw progress in place; None: when `out` is a terminal or this
        process is a Jupyter kernel.
    """

    def __init__(self, *, out: IO[str], err: IO[str], live: bool | None = None):
        self.lock = threading.Lock()
        self._sinks = {"out": out, "err": err}
        self._broken: set[str] = set()
        if live is None:
            live = _isatty(out) or "ipykernel" in sys.modules
        self.live = live
        self._live_owner: object = None
        self._live_text = ""
        self._drawn = 0  # visible characters of the live line on screen

    def line(self, kind: str, text: str, *, owner: object = None) -> None:
        """Writes one line to 'out' or 'err'; `owner`'s live line, if any, becomes this line."""
        if not self.live:
            text = strip_escapes(text)
        with self.lock:
            if self._live_owner is not None:
                self._clear()
                if owner is not None and owner == self._live_owner:
                    self._live_owner, self._live_text = None, ""
            self._write(kind, text + "\n")
            if self._live_owner is not None:
                self._draw()

    def progress(self, text: str, *, owner: object) -> None:
        """Shows `text` as the live line (only when drawing live)."""
        if not self.live:
            return
        with self.lock:
            if self._live_owner is not None and self._live_owner != owner:
                self._clear()
            self._live_owner, self._live_text = owner, text
            self._draw()

    def end_live(self, owner: object) -> None:
        """Removes `owner`'s live line, if it has one."""
        with self.lock:
            if self._live_owner is not None and self._live_owner == owner:
                self._clear()
                self._live_owner, self._live_text = None, ""

    def _width(self) -> int | None:
        try:
            return os.get_terminal_size(self._sinks["out"].fileno()).columns
        except (AttributeError, ValueError, OSError):  # not a terminal
            return None

    def _draw(self) -> None:
        width = self._width()
        text = self._live_text if width is None else _fit(self._live_text, max(1, width - 1))
        shown = _visible_width(text)
        self._write("out", "\r" + text + " " * max(0, self._drawn - shown), flush=True)
        self._drawn = shown

    def _clear(self) -> None:
        if self._drawn:
            self._write("out", "\r" + " " * self._drawn + "\r", flush=False)
            self._drawn = 0

    def _write(self, kind: str, text: str, flush: bool = True) -> None:
        if kind in self._broken:
            return
        sink = self._sinks[kind]
        try:
            sink.write(text)
            if flush:
                sink.flush()
        except (BrokenPipeError, ValueError, OSError):
            # Our reader went away: keep draining the tasks, write nothing more.
            self._broken.add(kind)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class TaskOutput:
    """What the relay knows about one task's output."""

    def __init__(self, name: str, tail_lines: int = 20):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.last_output = time.monotonic()
        self.hidden_lines = 0
        self.open_pipes = 0


def _keep_latest_state(buf: bytearray) -> None:
    """Drops what a line rewritten in place (`\\r`) has already overwritten."""
    end = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
    cut = buf.rfind(b"\r", 0, end)
    if cut > 0:
        del buf[:cut]


def _final_state(line: str) -> tuple[str, bool]:
    """(what a terminal would show for `line`, whether it was rewritten in place)."""
    body = line[:-1] if line.endswith("\r") else line
    if "\r" not in body and "\b" not in body:
        return body, False
    segments = [s for s in body.replace("\b", "").split("\r") if s.strip()]
    return (segments[-1].rstrip() if segments else ""), True


class Relay:
    """Copies the tasks' pipes to the console with a prefix, from one thread.

    Args:
      console: where lines go (shared with the launcher's own messages).
      display: what is shown (default: `Display()`).
    """

    def __init__(self, *, console: Console, display: Display | None = None):
        self._console = console
        self._display = display or Display()
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

    def _is_main(self, task: TaskOutput) -> bool:
        return task.name == self._display.main_task

    def _emit(self, task: TaskOutput, kind: str, raw: bytes, cut: bool = False) -> None:
        text, rewritten = _final_state(raw.decode("utf-8", "replace"))
        plain = strip_escapes(text)
        task.tail.append(plain)
        display = self._display
        hide = False
        if not display.keeps_tf_logs and (STARTUP_LINES.match(plain) or INFO_LINES.match(plain)):
            hide = True
        elif (display.show == "main" and not self._is_main(task)
              and (rewritten or PROGRESS_LINES.match(plain))):
            hide = True
        if hide:
            task.hidden_lines += 1
            self._console.end_live((task.name, kind))
            return
        self._console.line(kind, f"[{task.name}] {text}{_CUT if cut else ''}",
                           owner=(task.name, kind))

    def _show_live(self, task: TaskOutput, kind: str, buf: bytearray) -> None:
        """Draws the main task's line in progress (its latest in-place state) live."""
        if not (self._console.live and self._is_main(task)):
            return
        if b"\r" not in buf and b"\b" not in buf:
            return
        text, _ = _final_state(bytes(buf).decode("utf-8", "ignore"))
        if text:
            self._console.progress(f"[{task.name}] {text}", owner=(task.name, kind))

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
                    if len(buf) > MAX_LINE:
                        _keep_latest_state(buf)
                    while len(buf) > MAX_LINE:
                        self._emit(task, kind, bytes(buf[:MAX_LINE]), cut=True)
                        del buf[:MAX_LINE]
                    self._show_live(task, kind, buf)
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
        if len(line) > MAX_LINE:
            line = bytearray(line)
            _keep_latest_state(line)
            line = bytes(line)
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
