"""The job keeper: one small process per launched job (standard library only).

    python -I -S _keeper.py [--private-network]

It outlives the launcher by design. The launcher writes one line per task
process group to the keeper's stdin (`+PGID` when a task starts, `-PGID` once
the launcher has reaped that group). When stdin reaches end of file (the
launcher exited, or was SIGKILLed: the kernel closes its end of the pipe) the
keeper SIGKILLs every group still listed and, with --private-network, every
process left in the job's network namespace, so a task's children and
grandchildren die with the launcher even when they changed process group.

With --private-network it first moves itself into a new network namespace
that holds only a loopback interface (as root directly; otherwise inside a
new user namespace that maps the caller's own uid and gid onto themselves),
brings loopback up, and the tasks join that namespace (see _enter.py). It
answers on stdout with one line: `ready private` or `ready host`, or
`unavailable <reason>` when the namespace cannot be made (then it keeps the
process groups like `ready host`).

It runs as a script with `-I -S` (no site, no user environment): it must
start fast and must not import the user's code or TensorFlow.
"""

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import sys
import time

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ = "16sh22x"  # struct ifreq: name, then the flags member of its 24-byte union


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _unshare(libc, flags: int) -> None:
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def make_private_network() -> str:
    """Moves this process into a fresh loopback-only network namespace.

    Returns "root" or "user namespace" (how it was made).

    Raises:
      OSError: the kernel or its policy does not allow it.
    """
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, f"network namespaces need Linux (this is {sys.platform})")
    libc = _libc()
    try:
        _unshare(libc, CLONE_NEWNET)
        how = "root"
    except OSError as e:
        if e.errno != errno.EPERM:
            raise
        # Not privileged: a user namespace gives this process the capabilities
        # to make a network namespace, for itself only. Map our own ids onto
        # themselves, so files the tasks write keep their owner.
        uid, gid = os.geteuid(), os.getegid()
        try:
            _unshare(libc, CLONE_NEWUSER)
        except OSError as user_error:
            raise OSError(user_error.errno,
                          f"no permission for a network namespace ({e.strerror}), and "
                          f"unprivileged user namespaces are not allowed here "
                          f"({user_error.strerror})") from None
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
        _unshare(libc, CLONE_NEWNET)
        how = "user namespace"
    _loopback_up()
    return how


def _net_namespace() -> tuple[int, int]:
    st = os.stat("/proc/self/ns/net")
    return st.st_dev, st.st_ino


def processes_in_namespace(namespace: tuple[int, int]) -> list[int]:
    """Pids (other than ours) whose network namespace is `namespace`."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            st = os.stat(f"/proc/{name}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == namespace:
            found.append(int(name))
    return found


def kill_all(groups: set[int], namespace: tuple[int, int] | None) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    if namespace is None:
        return
    # Processes may fork while we kill: sweep until the namespace is empty.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = processes_in_namespace(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    namespace = None
    if "--private-network" in argv:
        try:
            make_private_network()
            namespace = _net_namespace()
            print("ready private", flush=True)
        except OSError as e:
            print(f"unavailable {e.strerror or e}", flush=True)
    else:
        print("ready host", flush=True)
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        try:
            if line.startswith("+"):
                groups.add(int(line[1:]))
            elif line.startswith("-"):
                groups.discard(int(line[1:]))
            elif line == "sweep" and namespace is not None:
                kill_all(set(), namespace)
                print("swept", flush=True)
        except ValueError:
            continue
    kill_all(groups, namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
