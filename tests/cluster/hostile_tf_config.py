"""A corpus of hostile TF_CONFIGs, run through `tfdist tf-config --check` and every preset.

    python tests/cluster/hostile_tf_config.py [--presets auto,multi_worker_mirrored] [--json OUT]

prints, per runner, how many cases ended as: clean error, accepted (valid
input), ignored (a preset that does not read TF_CONFIG ran), wrong but quiet
(invalid input accepted), traceback (any other exception), hang (no answer
within the timeout) or lost (the process died without a message).

`make_strategy` runs in one subprocess per preset, inside a private network
namespace with loopback only (`unshare --net`), so whatever address a case
names, no packet leaves the machine; each case runs in a child forked from
it (TensorFlow is imported once, before any runtime starts) with a bounded
timeout. The `--check` runner calls the command's `main` in one subprocess.
Run against another checkout with PYTHONPATH=that/checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

# Outcomes, in report order.
OUTCOMES = ("clean error", "accepted", "ignored", "wrong but quiet", "traceback", "hang", "lost")
# Presets that read TF_CONFIG; the others must merely not break on it.
CLUSTER_PRESETS = ("multi_worker_mirrored", "parameter_server", "auto")
CASE_TIMEOUT = 12.0
P1, P2, P3, P4 = 23456, 23457, 23458, 23459  # inside the private namespace: all free


def _tc(cluster: Any, task_type: Any = "worker", index: Any = 0, **extra: Any) -> str:
    value = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    value.update(extra)
    return json.dumps(value)


W2 = {"worker": [f"127.0.0.1:{P1}", f"127.0.0.1:{P2}"]}
FULL = {"chief": [f"127.0.0.1:{P1}"], "worker": [f"127.0.0.1:{P2}"], "ps": [f"127.0.0.1:{P3}"]}

# (address, valid?) substituted for worker:1 of a two-worker cluster.
ADDRESSES = [
    (f"localhost:{P2}", True), (f"[::1]:{P2}", True), (f"127.0.0.2:{P3}", True),
    ("no-such-host.invalid:2222", True),
    (f"127.0.0.1:{P1}", False), (f"localhost:{P1}", False), (f"[::1]:{P1}", False),
    (f"[0:0:0:0:0:0:0:1]:{P1}", False), (f"[::ffff:127.0.0.1]:{P1}", False),
    (f"127.0.0.2:{P1}", False), ("[fe80::1%a]b]:2222", False), ("[fe80::1%\udcff]:2222", False),
    ("[fe80::1%eth0/1]:2", False), ("127.0.0.1", False), (":2222", False), ("a:0", False),
    ("a:65536", False), ("a:-1", False), ("a:http", False), ("a:", False),
    ("grpc://a:1", False), (" a:1", False), ("a b:1", False), ("::1:2222", False),
    ("[::1]", False), ("[zz::1]:1", False), ("bad_host!:1", False), ("-a:1", False),
    ("10.0.0.256:1", False), ("10.0.0:1", False), ("a:\u0663", False), ("a:0002222", False),
    ("h\u00e9:1", False), ("a:1\n", False), ("a]:1", False), ("0x7f.1:1", False),
    ("0.0.0.0:1", False), ("[::]:1", False), ("224.0.0.1:1", False), ("a" * 400 + ":1", False),
    ("a:1:2", False), ("[::1]:1:2", False), ("", False), (2222, False), (None, False),
    (["a:1"], False), ({"host": "a"}, False), (1.5, False), (True, False),
]

# (task type, index, valid?) for the two-worker cluster.
TASKS = [
    ("worker", 1, True), ("worker", 2, False), ("worker", -1, False), ("worker", "0", False),
    ("worker", 0.5, False), ("worker", True, False), ("worker", 10 ** 30, False),
    ("worker", None, False), ("worker", 1e400, False), ("Worker", 0, False),
    ("workers", 0, False), ("master", 0, False), ("chief", 0, False), ("ps", 0, False),
    ("", 0, False), (None, 0, False), (0, 0, False), (["worker"], 0, False),
    ("\udcff", 0, False), ("evaluator", 0, "evaluator"), ("evaluator", 1, False),
]

TEXTS = [
    # label, text (str or bytes), valid?
    ("deep nesting", "[" * 3000 + "]" * 3000, False),
    ("deep nesting in task", '{"cluster": {"worker": ["a:1"]}, "task": ' + "[" * 2500
     + "]" * 2500 + "}", False),
    ("index of 5000 digits", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", '
     '"index": ' + "9" * 5000 + "}}", False),
    ("index NaN", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": NaN}}',
     False),
    ("index Infinity", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", '
     '"index": -Infinity}}', False),
    ("invalid UTF-8 bytes", b'{"cluster": {"worker": ["\xff\xfe:1"]}, "task": {"type": '
     b'"worker", "index": 0}}', False),
    ("invalid UTF-8 scope", b'{"cluster": {"worker": ["[fe80::1%\xff]:2222"]}, "task": '
     b'{"type": "worker", "index": 0}}', False),
    ("BOM", "\ufeff" + _tc(W2), False),
    ("python dict", str({"cluster": W2, "task": {"type": "worker", "index": 0}}), False),
    ("trailing garbage", _tc(W2) + " x", False),
    ("empty", "", "no cluster"),
    ("blank", "  \n", "no cluster"),
    ("empty object", "{}", "no cluster"),
    ("null", "null", False),
    ("list", "[]", False),
    ("number", "1", False),
    ("string", '"worker"', False),
    ("no task", json.dumps({"cluster": W2}), False),
    ("no cluster", json.dumps({"task": {"type": "worker", "index": 0}}), False),
    ("task list", json.dumps({"cluster": W2, "task": ["worker", 0]}), False),
    ("task without index", json.dumps({"cluster": W2, "task": {"type": "worker"}}), False),
    ("task without type", json.dumps({"cluster": W2, "task": {"index": 0}}), False),
    ("cluster list", _tc([["a:1"]]), False),
    ("cluster empty", _tc({}), False),
    ("role a string", _tc({"worker": "a:1"}), False),
    ("role a mapping", _tc({"worker": {"0": "a:1"}}), False),
    ("sparse role", _tc({"worker": {"1": "a:1"}}, index=1), False),
    ("unknown role", _tc({"worker": ["a:1"], "workers": ["b:1"]}), False),
    ("evaluator in cluster", _tc({"worker": ["a:1"], "evaluator": ["e:1"]}), False),
    ("master in cluster", _tc({"master": [f"127.0.0.1:{P1}"], "worker": [f"127.0.0.1:{P2}"]},
                              "master"), False),
    ("master and chief", _tc({"master": ["m:1"], "chief": ["c:1"], "worker": ["a:1"]}), False),
    ("two chiefs", _tc({"chief": ["c:1", "d:1"], "worker": ["a:1"]}, "chief"), False),
    ("ps only", _tc({"ps": ["p:1"]}, "ps"), False),
    ("rpc_layer bad", _tc(W2, rpc_layer="GRPC "), False),
    ("rpc_layer number", _tc(W2, rpc_layer=5), False),
    ("5000 workers one address", _tc({"worker": ["a:1"] * 5000}), False),
    ("unknown top-level key", _tc(W2, clusterr={}), True),
    ("mixed loopback and remote", _tc({"worker": [f"127.0.0.1:{P1}", f"node2:{P2}"]}), True),
    ("single worker", _tc({"worker": [f"127.0.0.1:{P1}"]}), True),
    ("single worker, other host", _tc({"worker": ["no-such-host.invalid:2222"]}), True),
    ("chief + worker + ps, chief", _tc(FULL, "chief"), True),
    ("chief + worker + ps, worker", _tc(FULL, "worker"), True),
    ("chief + worker + ps, ps", _tc(FULL, "ps"), True),
    ("worker + ps, no chief, ps task", _tc({"worker": [f"127.0.0.1:{P1}"],
                                             "ps": [f"127.0.0.1:{P2}"]}, "ps"), True),
    ("chief + 2 workers, chief", _tc({"chief": [f"127.0.0.1:{P1}"], "worker": [
        f"127.0.0.1:{P2}", f"127.0.0.1:{P3}"]}, "chief"), True),
]


def corpus() -> list[dict]:
    """Every case: {'label', 'value' (str or bytes), 'valid': True/False/'no cluster'/...}."""
    cases = []
    for address, valid in ADDRESSES:
        cluster = {"worker": [f"127.0.0.1:{P1}", address]}
        cases.append({"label": f"worker:1 address {address!r}"[:80],
                      "value": _tc(cluster), "valid": valid})
    for task_type, index, valid in TASKS:
        cases.append({"label": f"task {task_type!r} index {index!r}"[:80],
                      "value": _tc(W2, task_type, index), "valid": valid})
    for label, text, valid in TEXTS:
        cases.append({"label": label, "value": text, "valid": valid})
    # Every truncation of a valid TF_CONFIG is invalid JSON.
    full = _tc(FULL, "chief")
    for cut in range(5, len(full) - 1, max(1, len(full) // 12)):
        cases.append({"label": f"truncated at {cut}", "value": full[:cut], "valid": False})
    return cases


# ----------------------------------------------------------------------- running


def _set_tf_config(value) -> None:
    if isinstance(value, bytes):
        os.environb[b"TF_CONFIG"] = value
    else:
        os.environ["TF_CONFIG"] = value.encode("utf-8", "surrogateescape").decode(
            "utf-8", "surrogateescape")


def run_check(cases: list[dict]) -> list[dict]:
    """`tfdist tf-config --check` on each case, in this process."""
    from absl import flags

    from tfdist.commands import tf_config as command

    flags.FLAGS(["tfdist tf-config", "--check"])
    results = []
    for case in cases:
        _set_tf_config(case["value"])
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = command.main(["tfdist tf-config"])
            outcome = {0: "ok", 1: "error", 2: "unset"}.get(code, f"exit {code}")
            text = (out.getvalue() + err.getvalue())[-400:]
            if "Traceback" in text:
                outcome = "traceback"
        except BaseException as e:  # noqa: BLE001 - classify anything that escapes
            outcome, text = "traceback", f"{type(e).__name__}: {str(e)[:300]}"
        results.append({"outcome": outcome, "message": text})
    return results


def _child(preset: str, value, write_fd: int) -> None:
    """In the forked child: make the strategy, report, exit without cleanup."""
    import tfdist

    _set_tf_config(value)
    options = {"multi_worker_mirrored": {"join_timeout": 4},
               "parameter_server": {"connect_timeout": 4}}.get(preset, {})
    try:
        strategy = tfdist.make_strategy(preset, **options)
        result = {"outcome": "ok", "message": type(strategy).__name__}
    except BaseException as e:  # noqa: BLE001
        result = _exception(e)
    os.write(write_fd, json.dumps(result).encode())
    os._exit(0)


def _exception(e: BaseException) -> dict:
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    origin = frames[-1].filename if frames else ""
    return {"outcome": "exception", "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)[:400],
            # A tfdist message says what to change; TensorFlow's own does not.
            "from_tfdist": f"{os.sep}tfdist{os.sep}" in origin, "origin": origin}


def _private_network() -> None:
    """Moves this (forked) process into a new network namespace with loopback up."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def _fork_case(preset: str, value) -> dict:
    read_fd, write_fd = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.close(err_r)
        os.dup2(err_w, 2)
        os.setsid()  # our SIGKILL reaches this task and its join watchdog alone
        try:
            _private_network()  # every case has the machine's ports to itself
        except BaseException as e:  # noqa: BLE001
            os.write(write_fd, json.dumps({"outcome": "setup", "message": str(e)}).encode())
            os._exit(1)
        _child(preset, value, write_fd)
    os.close(write_fd)
    os.close(err_w)
    return {"pid": pid, "fds": {read_fd: [], err_r: []}, "out": read_fd, "err": err_r,
            "deadline": time.monotonic() + CASE_TIMEOUT}


def _finish(run: dict, status) -> dict:
    for fd, sink in run["fds"].items():
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 65536)
            if not data:
                break
            sink.append(data)
        os.close(fd)
    try:
        os.killpg(run["pid"], signal.SIGKILL)  # e.g. the join watchdog
    except (ProcessLookupError, PermissionError):
        pass
    out = b"".join(run["fds"][run["out"]])
    stderr = b"".join(run["fds"][run["err"]]).decode("utf-8", "replace")
    if status == "timeout":
        return {"outcome": "serving" if "serving at" in stderr else "timeout",
                "message": stderr[-300:]}
    if out:
        return json.loads(out)
    return {"outcome": "died", "status": status, "message": stderr[-400:]}


def run_make_strategy(preset: str, cases: list[dict], *, parallel: int = 12) -> list[dict]:
    """make_strategy(preset) on each case, each in a forked child, `parallel` at a time.

    Most cases end at once; the ones that wait (for peers that never come, or
    serving forever) wait side by side, so the runner takes about one timeout.
    """
    from tfdist._tf import import_tensorflow

    import_tensorflow()  # once, before forking; no runtime has started
    results: dict[int, dict] = {}
    pending = list(enumerate(cases))
    running: dict[int, dict] = {}
    while pending or running:
        while pending and len(running) < parallel:
            i, case = pending.pop(0)
            running[i] = _fork_case(preset, case["value"])
        fds = [fd for run in running.values() for fd in run["fds"]]
        ready, _, _ = select.select(fds, [], [], 0.2)
        for run in running.values():
            for fd in ready:
                if fd in run["fds"]:
                    data = os.read(fd, 65536)
                    if data:
                        run["fds"][fd].append(data)
        for i, run in list(running.items()):
            done, status = os.waitpid(run["pid"], os.WNOHANG)
            if done:
                results[i] = _finish(run, status)
                del running[i]
            elif time.monotonic() > run["deadline"]:
                os.killpg(run["pid"], signal.SIGKILL)
                os.waitpid(run["pid"], 0)
                results[i] = _finish(run, "timeout")
                del running[i]
    return [results[i] for i in range(len(cases))]


def run_in_process(presets: list[str], cases: list[dict]) -> dict[str, list[dict]]:
    """make_strategy(preset) on each case in this process: for presets that start no cluster."""
    import tfdist

    out = {}
    for preset in presets:
        results = out[preset] = []
        for case in cases:
            _set_tf_config(case["value"])
            try:
                strategy = tfdist.make_strategy(preset)
                results.append({"outcome": "ok", "message": type(strategy).__name__})
            except BaseException as e:  # noqa: BLE001
                results.append(_exception(e))
    return out


# ----------------------------------------------------------------------- classifying


def classify_check(case: dict, result: dict) -> str:
    valid, outcome = case["valid"], result["outcome"]
    if outcome == "traceback" or outcome.startswith("exit"):
        return "traceback"
    if valid == "no cluster":
        return "accepted" if outcome == "unset" else "wrong but quiet"
    if valid is False:
        return "clean error" if outcome == "error" else "wrong but quiet"
    return "accepted" if outcome == "ok" else "clean error"


_CLEAN = ("ValueError", "RuntimeError", "ParameterServerError", "TFConfigError")


def _training_tasks(value) -> int:
    try:
        cluster = json.loads(value)["cluster"]
        return len(cluster.get("chief", [])) + len(cluster.get("worker", []))
    except Exception:  # noqa: BLE001
        return 0


def classify_strategy(preset: str, case: dict, result: dict) -> str:
    valid, outcome = case["valid"], result["outcome"]
    reads = preset in CLUSTER_PRESETS
    if outcome == "setup":
        raise RuntimeError(f"the runner could not isolate a case: {result['message']}")
    if outcome == "timeout":
        # 'auto' has no join_timeout option: a valid cluster waits the preset's
        # default (120 s) for peers that the corpus never starts, then ends
        # with the join watchdog's message. Only a one-task cluster may not wait.
        if preset == "auto" and valid is True and _training_tasks(case["value"]) > 1:
            return "accepted"
        return "hang"
    if outcome == "serving":
        # A ps/worker task serves until stopped: right when a chief (the
        # coordinator) will come, a hang when the cluster has none.
        return "accepted" if valid is True and '"chief"' in str(case["value"]) else "hang"
    if outcome == "died":
        # The join watchdog prints why and kills the task: a clean end for an
        # absent peer (the corpus never starts the other tasks).
        return "clean error" if "gave up after waiting" in result.get("message", "") else "lost"
    if outcome == "ok":
        if not reads:
            return "ignored"
        return "wrong but quiet" if valid is False else "accepted"
    if not (result.get("from_tfdist") and any(n in result.get("mro", ()) for n in _CLEAN)):
        return "traceback"
    if not reads and valid is not False:
        return "traceback"  # a preset that does not need TF_CONFIG failed on a valid one
    return "clean error"


# ----------------------------------------------------------------------- driver


def netns_prefix() -> list[str] | None:
    """`unshare --net` with loopback up, if this machine allows it (root), else None."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return None
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "netns"]


def run_all(presets: list[str], *, timeout: float = 600) -> dict:
    """{'check': [result per case], preset: [...]}: one subprocess per runner, side by side.

    Presets that read TF_CONFIG run each case in a forked child (a case may
    start a server, wait for peers or serve forever); the others run every
    case in their one process.
    """
    cases = corpus()
    me = os.path.abspath(__file__)
    prefix = netns_prefix()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    commands = {"check": [sys.executable, me, "--_runner=check"]}
    report: dict = {"cases": [c["label"] for c in cases]}
    if prefix is None:
        report["skipped"] = "make_strategy runners need `unshare --net` (root)"
    else:
        local = [p for p in presets if p not in CLUSTER_PRESETS]
        if local:  # presets that start no cluster share one process
            commands["local"] = prefix + [sys.executable, me, f"--_runner={','.join(local)}",
                                          "--_mode=inprocess"]
        for preset in presets:
            if preset in CLUSTER_PRESETS:
                commands[preset] = prefix + [sys.executable, me, f"--_runner={preset}",
                                             "--_mode=fork"]
    procs = {name: subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, start_new_session=True)
             for name, args in commands.items()}
    deadline = time.monotonic() + timeout
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"runner {name} failed ({proc.returncode}): {err[-2000:]}")
            result = json.loads(out.splitlines()[-1])
            report.update(result if name == "local" else {name: result})
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return report


def tables(report: dict) -> tuple[str, dict]:
    cases = corpus()
    counts = {}
    lines = [f"{'runner':<24}" + "".join(f"{o:>16}" for o in OUTCOMES)]
    for runner, results in report.items():
        if runner in ("cases", "skipped"):
            continue
        classes = [classify_check(c, r) if runner == "check" else
                   classify_strategy(runner, c, r) for c, r in zip(cases, results)]
        counts[runner] = {o: classes.count(o) for o in OUTCOMES}
        counts[runner]["_bad"] = [(c["label"], k, r.get("type", ""), r.get("message", "")[:160])
                                  for c, r, k in zip(cases, results, classes)
                                  if k in ("wrong but quiet", "traceback", "hang", "lost")]
        lines.append(f"{runner:<24}" + "".join(f"{counts[runner][o]:>16}" for o in OUTCOMES))
    return "\n".join(lines), counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--_runner", default=None)
    parser.add_argument("--_mode", default="fork")
    args = parser.parse_args()
    if args._runner == "check":
        print(json.dumps(run_check(corpus())))
        return 0
    if args._runner:
        if args._mode == "fork":
            print(json.dumps(run_make_strategy(args._runner, corpus())))
        else:
            print(json.dumps(run_in_process(args._runner.split(","), corpus())))
        return 0
    import tfdist

    presets = args.presets.split(",") if args.presets else list(tfdist.available_presets())
    report = run_all(presets)
    text, counts = tables(report)
    print(f"{len(report['cases'])} cases\n{text}")
    for runner, c in counts.items():
        for label, kind, etype, message in c["_bad"]:
            print(f"  {runner}: {kind}: {label}: {etype} {message}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report, "counts": counts}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
