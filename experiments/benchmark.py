"""The whole benchmark report: `python -m experiments.benchmark [--quick]`.

Runs tfdist's benchmarks side by side and writes results/benchmark.json,
results/benchmark.md (row, measured, target, ratio, note) and PNG plots;
`--docs_dir=docs/performance` copies the table and plots there.

- Every module (experiments.bench_presets first, then BENCH_MODULES) runs
  `run(quick)` in its own fresh process (its own device layout, threads and
  collectives, its own absl flags); a module that is not installed is
  reported as "not available". This process never starts TensorFlow, so
  multi-process rounds share the machine with no idle runtime of ours; the
  machine's load average is recorded before and after every module.
- bench_presets (4 logical CPUs): wrapper overhead, mirrored scaling with and
  without steps_per_execution, FLOP utilisation, the all-reduce cost model
  against 2 local workers; its plot data comes back with its rows.

The report of record is one run, alone on the machine:

    python -m experiments.benchmark --docs_dir=docs/performance
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

# Other issues' benchmark modules (experiments/bench_<topic>.py with run(quick) -> rows).
BENCH_MODULES = ("bench_multiworker", "bench_comm", "bench_allreduce", "bench_ps",
                 "bench_split", "bench_sharding")
ROW_KEYS = ("name", "value", "unit", "target", "ratio", "note")

_QUICK = flags.DEFINE_bool("quick", False, "CI smoke run: fewer, shorter rounds (~1-2 min).")
_OUT_DIR = flags.DEFINE_string("out_dir", "results", "Where to write benchmark.json/.md/PNGs.")
_DOCS_DIR = flags.DEFINE_string("docs_dir", None,
                                "Also copy the markdown table and plots here (docs/performance).")
_MODULES = flags.DEFINE_list("modules", list(BENCH_MODULES),
                             "Other benchmark modules to run (empty: only bench_presets).")
_MODULE_TIMEOUT = flags.DEFINE_float("module_timeout", None,
                                     "Seconds per module (default 300 quick, 1800 full).")

_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from experiments import {name} as module
if {name!r} == "bench_presets":
    rows, details = module.measure({quick})
    rows = [dict(row, details=details) if i == 0 else row for i, row in enumerate(rows)]
else:
    rows = module.run({quick})
with open({out!r}, "w") as f:
    json.dump(rows, f)
"""


def machine_description() -> dict:
    """What the absolute numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    # Versions from the installed packages: this process never starts TensorFlow.
    gpus = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)]) \
        if os.path.isdir("/dev") else 0
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "tensorflow": version("tensorflow"),
            "keras": version("keras"), "gpus": gpus}


def check_row(row: dict, source: str) -> dict:
    """A row in the suite's schema, or ValueError naming the module and what is wrong."""
    if not isinstance(row, dict) or set(ROW_KEYS) - set(row):
        raise ValueError(f"{source}: a row must be a dict with keys {', '.join(ROW_KEYS)}. "
                         f"Received: {row!r}")
    if not isinstance(row["value"], (int, float)) or isinstance(row["value"], bool):
        raise ValueError(f"{source}: row {row['name']!r} value must be a number. "
                         f"Received: value={row['value']!r}")
    checked = {**{k: row[k] for k in ROW_KEYS}, "source": source}
    if isinstance(row.get("details"), dict):  # bench_presets' plot data
        checked["details"] = row["details"]
    if isinstance(row.get("points"), list):  # raw (bytes, seconds) all-reduce points
        checked["points"] = row["points"]
    return checked


def validate_points_rows(rows: list[dict]) -> tuple[list[dict], dict]:
    """Cost-model rows for raw all-reduce points other modules report.

    A row with "points" ([{"bytes": k, "seconds": t}, ...] or [[k, t], ...],
    2 workers) is moved into the details, and the alpha-beta model is
    calibrated on every other size and judged on the rest, as for
    bench_presets' own measurement.
    """
    from experiments import bench_presets
    from tfdist import planning as cost  # the cost model

    new_rows, details = [], {}
    for row in rows:
        raw = row.pop("points", None)
        if not raw:
            continue
        points = [(p["bytes"], p["seconds"]) if isinstance(p, dict) else tuple(p) for p in raw]
        try:
            link, calibrate, predictions, errors = bench_presets.validate_allreduce(points)
        except ValueError as error:
            details[row["source"]] = {"points": points, "error": str(error)}
            continue
        within = sum(e <= bench_presets.ALLREDUCE_TOLERANCE for e in errors)
        new_rows.append({
            "name": f"all-reduce model error on {row['source']}'s points (held-out sizes, max)",
            "value": max(errors), "unit": "relative error",
            "target": bench_presets.ALLREDUCE_TOLERANCE,
            "ratio": max(errors) / bench_presets.ALLREDUCE_TOLERANCE,
            "note": f"{within}/{len(errors)} held-out sizes within +-30%; alpha "
                    f"{cost.format_seconds(link.latency)}, bandwidth "
                    f"{link.bandwidth / 1e9:.2f} GB/s (lower is better: ratio <= 1 passes)",
            "source": "benchmark"})
        details[row["source"]] = {"points": points, "alpha": link.latency,
                                  "bandwidth": link.bandwidth, "predictions": predictions}
    return new_rows, details


def run_module(name: str, *, quick: bool, timeout: float, root: str) -> tuple[str, list[dict]]:
    """(status, rows) of experiments.<name>.run(quick), run in a fresh process."""
    if not os.path.exists(os.path.join(root, "experiments", f"{name}.py")):
        return "not available", []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        code = _CHILD.format(root=root, name=name, quick=bool(quick), out=out)
        try:
            result = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=timeout,
                                    capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return f"failed: timed out after {timeout:.0f} s", []
        if result.returncode != 0 or not os.path.exists(out):
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            return f"failed (exit {result.returncode}): {last}", []
        with open(out) as f:
            raw = json.load(f)
    try:
        return "ok", [check_row(row, name) for row in raw]
    except ValueError as error:
        return f"failed: {error}", []


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['system']}; TensorFlow {m['tensorflow']}, "
        f"Keras {m['keras']}; {m['gpus']} GPU(s). Shared with other jobs: absolute numbers are "
        "this machine's and noisy; ratios are measured side by side in one run (medians).",
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['seconds']:.0f} s)",
        "",
        "| row | measured | target | ratio | note |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['name']} | {_fmt(row['value'])} {row['unit']} | "
                     f"{_fmt(row['target'])} | {_fmt(row['ratio'])} | {row['note']} |")
    loads = report.get("load_average", {})
    lines += ["", "| module | status | load average before -> after |", "|---|---|---|"]
    lines += [f"| {name} | {status} | " + (
        f"{loads[name]['before']:.1f} -> {loads[name]['after']:.1f}" if name in loads else "-")
        + " |" for name, status in report["modules"].items()]
    return "\n".join(lines) + "\n"


def plots(details: dict, out_dir: str) -> list[str]:
    """PNG plots: throughput per configuration, all-reduce model vs measurement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    throughput = details["throughput"]
    names = list(throughput)
    medians = [sorted(v)[len(v) // 2] for v in throughput.values()]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, medians, color="tab:blue")
    for i, values in enumerate(throughput.values()):
        ax.plot(values, [i] * len(values), "k.", markersize=3)
    ax.set_xlabel("samples/s (median bar, dots = rounds)")
    ax.set_title("MLP 784-512-512-10, global batch 256")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "throughput.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    ar = details["allreduce"]
    from tfdist import planning as cost  # the cost model

    link = cost.Link(bandwidth=ar["bandwidth"], latency=ar["alpha"])
    sizes = [k for k, _ in ar["points"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    calibrate = set(ar["calibration_sizes"])
    ax.loglog([k for k, _ in ar["points"] if k in calibrate],
              [t for k, t in ar["points"] if k in calibrate], "o", label="measured (calibration)")
    ax.loglog([k for k, _ in ar["points"] if k not in calibrate],
              [t for k, t in ar["points"] if k not in calibrate], "s", label="measured (held out)")
    grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 50) for i in range(51)]
    ax.loglog(grid, [cost.ring_allreduce_time(k, 2, link) for k in grid], "-",
              label=f"alpha-beta: a={cost.format_seconds(link.latency)}, "
                    f"{link.bandwidth / 1e9:.2f} GB/s")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title("Ring all-reduce, 2 local workers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "allreduce.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv):
    del argv
    start = time.perf_counter()
    quick = _QUICK.value
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    rows, details, modules, loads = [], {}, {}, {}
    timeout = _MODULE_TIMEOUT.value or (300.0 if quick else 1800.0)
    for name in ["bench_presets"] + [m for m in _MODULES.value if m != "bench_presets"]:
        before = os.getloadavg()[0]
        status, module_rows = run_module(name, quick=quick, timeout=timeout, root=root)
        loads[name] = (before, os.getloadavg()[0])
        for row in module_rows:
            details.update(row.pop("details", None) or {})
        modules[name] = status
        rows += module_rows
        print(f"benchmark: {name}: {status}", flush=True)
    model_rows, details["cost_model_on_module_points"] = validate_points_rows(rows)
    rows += model_rows
    report = {
        "command": "python -m experiments.benchmark" + (" --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick, "machine": machine_description(), "modules": modules,
        "load_average": {name: {"before": a, "after": b} for name, (a, b) in loads.items()},
        "rows": rows,
        "details": details,
    }
    os.makedirs(_OUT_DIR.value, exist_ok=True)
    pngs = plots(details, _OUT_DIR.value) if "throughput" in details else []
    report["plots"] = [os.path.basename(p) for p in pngs]
    report["seconds"] = time.perf_counter() - start
    with open(os.path.join(_OUT_DIR.value, "benchmark.json"), "w") as f:
        json.dump(report, f, indent=2)
    table = markdown(report)
    with open(os.path.join(_OUT_DIR.value, "benchmark.md"), "w") as f:
        f.write(table)
    if _DOCS_DIR.value:
        os.makedirs(_DOCS_DIR.value, exist_ok=True)
        with open(os.path.join(_DOCS_DIR.value, "benchmark.md"), "w") as f:
            f.write(table)
        for path in pngs:
            shutil.copy(path, _DOCS_DIR.value)
    print(table)


if __name__ == "__main__":
    app.run(main)
