"""Start one task: die with the launcher, join the job's namespaces, exec the command.

    python -I -S _enter.py PARENT_PID USERNS_FD NETNS_FD PROGRAM [ARGS...]

(`-1` for a namespace the task does not join.) The launcher starts every task
through this script instead of a `preexec_fn`, which is unsafe while the
launcher's output threads run. It replaces itself with the task's program
(same pid), so the launcher's process handle, the task's pid and its exit
status are the task's own. Standard library only.
"""

import ctypes
import os
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
_PREFIX = "[tfdist launch]"


def _fail(text: str, code: int) -> None:
    sys.stderr.write(f"{_PREFIX} {text}\n")
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    parent, userns_fd, netns_fd = int(argv[0]), int(argv[1]), int(argv[2])
    program = argv[3:]
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    for fd, kind, what in ((userns_fd, CLONE_NEWUSER, "user"), (netns_fd, CLONE_NEWNET, "network")):
        if fd < 0:
            continue
        if libc.setns(fd, kind) != 0:
            err = ctypes.get_errno()
            _fail(f"cannot join the job's private {what} namespace: {os.strerror(err)}. Run "
                  f"with --network=host to skip network isolation.", 1)
        os.close(fd)
    # After setns: a change of credentials may clear the parent-death signal.
    if libc is not None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            err = ctypes.get_errno()
            sys.stderr.write(
                f"{_PREFIX} warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}): this "
                f"task dies with the launcher only through the job keeper.\n")
    if os.getppid() != parent:
        _fail("the launcher exited before this task started; not starting it.", 1)
    try:
        os.execv(program[0], program)
    except OSError as e:
        # The launcher checked the program first; this is what slipped through.
        _fail(f"cannot run {program[0]!r}: {e.strerror}.", 127 if e.errno == 2 else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
