"""The report's plots from the benchmarks' JSON: `python -m experiments.plots`.

    python -m experiments.plots [--multiworker=results/bench_multiworker.json]
        [--cluster=results/bench_cluster.json] [--out_dir=docs/performance]

Reads what the benchmarks wrote with `--out` and draws, as PNG:

- `efficiency.png` (from `bench_multiworker --scaling_only`): efficiency against
  the independent-process control vs worker count, one line per variant and
  model, the rounds' spread as error bars;
- `link_step.png` (from `bench_cluster`): step time vs link rate per method, one
  panel per node count and model (log-log);
- `predicted_vs_measured.png` (from `bench_cluster`): the planner's predicted
  step against the measured one, with the ±30% band.

A plot whose input is missing is skipped and said so; a file that is not
such a benchmark's output is a clear error. Each plot's title carries its
baseline (the setup line the benchmark wrote).
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags

_CLUSTER_ROW = re.compile(r"^cluster/(\d+) nodes/([0-9.]+) Gbit/s-eq/([^/]+)/([^:]+): (\w[\w/ ]*)$")


def _define_flags() -> None:
    flags.DEFINE_string("multiworker", "results/bench_multiworker.json",
                        "bench_multiworker --scaling_only --out file.")
    flags.DEFINE_string("cluster", "results/bench_cluster.json", "bench_cluster --out file.")
    flags.DEFINE_string("out_dir", "docs/performance", "Where to write the PNG files.")


FLAGS = flags.FLAGS


def _load(path: str, what: str, key: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); expected the --out file of {what}.") from None
    if not isinstance(data, dict) or key not in data:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} has no {key!r}: expected the --out file of {what}. "
                         f"Received keys: {got}.")
    return data


def scaling_series(data: dict) -> dict:
    """{(model, variant): [(workers, efficiency, low, high), ...]} from bench_multiworker's JSON.

    low/high: the efficiency of the slowest and fastest round (the control's median step
    over each round's step).
    """
    out: dict = {}
    for model, table in data["scaling"].items():
        for n in sorted(table, key=int):
            t = table[n]
            control = t["control_ms"]
            for variant, eff in t["efficiency"].items():
                rounds = t.get("rounds", {}).get(variant) or [control / eff]
                out.setdefault((model, variant), []).append(
                    (int(n), eff, control / max(rounds), control / min(rounds)))
    return out


def cluster_points(data: dict) -> dict:
    """{(nodes, rate, model, method): {"step": ms, "predicted/measured": x, ...}} from the rows."""
    out: dict = {}
    for r in data["rows"]:
        m = _CLUSTER_ROW.match(r["name"])
        if m:
            nodes, rate, model, method, what = m.groups()
            out.setdefault((int(nodes), float(rate), model, method), {})[what] = r["value"]
    return out


def plot_efficiency(data: dict, path: str) -> str:
    plt = _pyplot()

    series = scaling_series(data)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (model, variant), points in sorted(series.items()):
        n = [p[0] for p in points]
        eff = [p[1] for p in points]
        err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(n, eff, yerr=err, marker="o", capsize=3, label=f"{model}: {variant}")
    ax.axhline(0.85, color="grey", linestyle=":", label="target 0.85")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p[0] for ps in series.values() for p in ps}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_ylim(0, max(1.1, max(p[3] for ps in series.values() for p in ps) * 1.05))
    ax.set_xlabel("workers")
    ax.set_ylabel("efficiency (control step / step)")
    load = data.get("load_average")
    ax.set_title("Multi-worker efficiency vs N independent processes\n"
                 + _short(data.get("command", ""))
                 + (f"\nload average at the end {load[0]:.1f}" if load else ""), fontsize=8)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_link_step(data: dict, path: str) -> str:
    plt = _pyplot()

    points = cluster_points(data)
    panels = sorted({(k[0], k[2]) for k in points})
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.5, 4.2 * len(panels)), 4.4),
                             squeeze=False)
    for ax, (nodes, model) in zip(axes[0], panels):
        methods = sorted({k[3] for k in points if k[0] == nodes and k[2] == model})
        for method in methods:
            series = sorted((k[1], v["step"]) for k, v in points.items()
                            if k[0] == nodes and k[2] == model and k[3] == method and "step" in v)
            ax.plot([s[0] for s in series], [s[1] for s in series], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({k[1] for k in points if k[0] == nodes and k[2] == model})
        ax.set_xticks(rates)
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("link (Gbit/s-equivalent)")
        ax.set_ylabel("step (ms)")
        ax.set_title(f"{nodes} nodes, {model}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Step time vs link rate per method\n" + _short(data.get("command", "")),
                 fontsize=8)
    return _save(plt, fig, path)


def plot_predicted(data: dict, path: str) -> str:
    plt = _pyplot()

    points = {k: v for k, v in cluster_points(data).items()
              if "step" in v and "predicted/measured" in v}
    fig, ax = plt.subplots(figsize=(5.5, 5))
    measured = [v["step"] for v in points.values()]
    for method in sorted({k[3] for k in points}):
        xs = [v["step"] for k, v in points.items() if k[3] == method]
        ys = [v["step"] * v["predicted/measured"] for k, v in points.items() if k[3] == method]
        ax.scatter(xs, ys, label=method)
    if measured:
        lo, hi = min(measured) * 0.5, max(measured) * 2
        ax.plot([lo, hi], [lo, hi], "k-", linewidth=0.8, label="predicted = measured")
        ax.fill_between([lo, hi], [lo * 0.7, hi * 0.7], [lo * 1.3, hi * 1.3], color="grey",
                        alpha=0.2, label="±30%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("planner's predicted step (ms)")
    ax.set_title("Planner: predicted vs measured\n" + _short(data.get("command", "")),
                 fontsize=8)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short(text: str, width: int = 72) -> str:
    """The command, wrapped to fit a title (three lines at most)."""
    import textwrap

    text = re.sub(r" --out=\S+", "", text.replace("python -m experiments.", ""))
    lines = textwrap.wrap(text, width)
    return "\n".join(lines[:3]) + ("..." if len(lines) > 3 else "")


def make_plots(*, multiworker: str | None, cluster: str | None, out_dir: str,
               log=print) -> list[str]:
    """The PNGs whose inputs exist; says which were skipped and why."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if multiworker and os.path.isfile(multiworker):
        data = _load(multiworker, "bench_multiworker --scaling_only", "scaling")
        written.append(plot_efficiency(data, os.path.join(out_dir, "efficiency.png")))
    else:
        log(f"plots: efficiency.png skipped: no {multiworker} (run python -m "
            f"experiments.bench_multiworker --scaling_only --out={multiworker})")
    if cluster and os.path.isfile(cluster):
        data = _load(cluster, "bench_cluster", "rows")
        if not cluster_points(data):
            raise ValueError(f"{cluster} has no cluster/... rows: expected the --out file of "
                             "bench_cluster.")
        written.append(plot_link_step(data, os.path.join(out_dir, "link_step.png")))
        written.append(plot_predicted(data, os.path.join(out_dir, "predicted_vs_measured.png")))
    else:
        log(f"plots: link_step.png and predicted_vs_measured.png skipped: no {cluster} (run "
            f"python -m experiments.bench_cluster --out={cluster})")
    for path in written:
        log(f"plots: wrote {path}")
    return written


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    make_plots(multiworker=FLAGS.multiworker, cluster=FLAGS.cluster, out_dir=FLAGS.out_dir)


if __name__ == "__main__":
    _define_flags()
    try:
        app.run(main)
    except ValueError as e:
        sys.exit(f"plots: {e}")
