"""experiments/bench_comm.py's wire counter (bytes_sent of `ss -ti`), which the shaped-link,
cluster and comm benchmarks report as "worker 0 sent ... MB/step"."""

import math
import os
import socket
import subprocess
import threading

from experiments import bench_comm

_HEAD = "ESTAB 0 0 {local} {peer} users:((\"python\",pid={pid},fd=7))\n"
_INFO = "\t cubic wscale:7,7 rto:204 mss:1448 bytes_sent:{sent} bytes_acked:{sent} segs_out:9\n"


def _ss_printing(monkeypatch, sockets, pid=41):
    """`ss` answers with `sockets` ({(local, peer): bytes_sent}) owned by `pid`."""
    text = "".join(_HEAD.format(local=l, peer=p, pid=pid) + _INFO.format(sent=n)
                   for (l, p), n in sockets.items())
    monkeypatch.setattr(bench_comm.subprocess, "run", lambda args, **kw:
                        subprocess.CompletedProcess(args, 0, stdout=text, stderr=""))


def test_a_connection_closed_between_snapshots_does_not_go_below_zero(monkeypatch):
    old, kept, new = ("a:1", "b:2"), ("a:1", "c:3"), ("a:1", "d:4")
    _ss_printing(monkeypatch, {old: 16_000_000, kept: 1000})
    before = bench_comm.tcp_bytes_by_socket(41)
    _ss_printing(monkeypatch, {kept: 1500, new: 8_000_000})
    # Summing whatever is open (as the benchmarks did) would read 8,001,500 - 16,001,000 < 0.
    assert bench_comm.tcp_bytes_sent_since(before, 41) == 500 + 8_000_000
    _ss_printing(monkeypatch, {kept: 1500}, pid=42)  # another process's sockets are not ours
    assert bench_comm.tcp_bytes_sent_since(before, 41) == 0
    assert bench_comm.tcp_bytes_sent_since(before, None) == 500  # a node: every socket


def test_a_failing_ss_is_unknown_not_zero(monkeypatch, capfd):
    def fail(args, **kw):
        raise FileNotFoundError(2, "No such file or directory", "ss")

    monkeypatch.setattr(bench_comm.time, "sleep", lambda s: None)
    monkeypatch.setattr(bench_comm.subprocess, "run", fail)
    assert bench_comm.tcp_bytes_by_socket(None) is None
    assert math.isnan(bench_comm.tcp_bytes_sent_since({("a:1", "b:2"): 5}, None))
    assert "ss -tinH failed 3 times" in capfd.readouterr().err


def test_counts_this_process_real_socket():
    server = socket.create_server(("127.0.0.1", 0))
    sink = []
    threading.Thread(target=lambda: sink.append(server.accept()[0].makefile("rb").read()),
                     daemon=True).start()
    client = socket.create_connection(server.getsockname())
    try:
        client.sendall(b"x" * 1000)
        before = bench_comm.tcp_bytes_by_socket(os.getpid())
        assert before, "ss lists this process's connection"
        client.sendall(b"x" * 300_000)
        assert bench_comm.tcp_bytes_sent_since(before, os.getpid()) == 300_000
    finally:
        client.close()
        server.close()


def test_ss_reading_proc_instead_of_netlink_is_read_again(monkeypatch):
    # ss falls back to /proc/net/tcp when its netlink query fails, exit 0, no tcp_info:
    # read as "no bytes", the shaped-link benchmark once reported -5.366 MB/step.
    fallback = ("ESTAB 0 0 [::ffff:192.0.2.1]:47001 [::ffff:192.0.2.2]:42454 "
                "rto:0.2 cwnd:80 reordering:0\n")
    netlink = (_HEAD.format(local="[::ffff:192.0.2.1]:47001", peer="[::ffff:192.0.2.2]:42454",
                            pid=41)
               + "\t bbr wscale:10,10 rto:212 mss:1448 bytes_sent:24139110 segs_out:9\n")
    answers = [fallback, netlink]
    monkeypatch.setattr(bench_comm.time, "sleep", lambda s: None)
    monkeypatch.setattr(bench_comm.subprocess, "run", lambda args, **kw:
                        subprocess.CompletedProcess(args, 0, stdout=answers.pop(0), stderr=""))
    assert bench_comm.tcp_bytes_by_socket(None) == {
        ("[::ffff:192.0.2.1]:47001", "[::ffff:192.0.2.2]:42454"): 24139110}
    assert not answers


def test_an_ss_that_always_reads_proc_is_unknown(monkeypatch, capfd):
    # PROC_NET_TCP makes the real ss take its /proc path every time (a socket is open: ours).
    monkeypatch.setenv("PROC_NET_TCP", "/proc/net/tcp")
    monkeypatch.setattr(bench_comm.time, "sleep", lambda s: None)
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        assert bench_comm.tcp_bytes_by_socket(None) is None
        assert "no tcp_info: ss read /proc/net/tcp instead of netlink" in capfd.readouterr().err
        monkeypatch.delenv("PROC_NET_TCP")
        assert bench_comm.tcp_bytes_by_socket(None) is not None
    finally:
        client.close()
        server.close()
