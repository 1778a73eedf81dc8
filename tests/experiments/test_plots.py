"""experiments/plots.py: the report's three plots from the benchmarks' own output formats."""

import json

import pytest

from experiments import bench_cluster, bench_multiworker, plots
from experiments.rows import row

PNG = b"\x89PNG\r\n\x1a\n"


def _scaling_json(tmp_path):
    """bench_multiworker's --out file: its scaling_table of a made-up curve, through JSON."""
    def result(ms):
        return {"step_seconds": ms / 1e3, "cpu_seconds_per_step": ms / 1e3, "threads": 40,
                "input_seconds_per_step": 1e-3}

    curve = {"tiny": {
        "tfdist": {1: [result(2.0)] * 3, 2: [result(8.0), result(9.0), result(10.0)]},
        "stock": {1: [result(1.8)] * 3, 2: [result(6.0)] * 3},
        "control": {1: [], 2: [result(2.2)] * 3}}}
    path = tmp_path / "multiworker.json"
    path.write_text(json.dumps({"rows": [], "command": "bench_multiworker --scaling_only",
                                "scaling": bench_multiworker.scaling_table(curve)}))
    return path


def _cluster_json(tmp_path):
    """bench_cluster's rows (names from its config_name) at two rates."""
    rows = []
    for rate, none_ms, psgd_ms in ((1.0, 1700.0, 54.0), (25.0, 150.0, 40.0)):
        for method, ms in (("none", none_ms), ("powersgd", psgd_ms)):
            name = bench_cluster.config_name(2, rate, "mlp", method)
            rows += [row(f"{name}: step", ms, "ms"), row(f"{name}: wire", 1.0, "MB/step"),
                     row(f"{name}: hidden", 0.0, "fraction"),
                     row(f"{name}: predicted/measured", 0.85, "x")]
    rows.append(row("cluster target: powersgd / none step rate, mlp, 2 nodes", 31.0, "x"))
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"rows": rows, "command": "bench_cluster"}))
    return path


def test_the_three_plots_from_the_benchmarks_output(tmp_path):
    multiworker, cluster = _scaling_json(tmp_path), _cluster_json(tmp_path)
    series = plots.scaling_series(json.loads(multiworker.read_text()))
    # Efficiency = the control's step / the variant's median step; the bars are the rounds'.
    assert series[("tiny", "tfdist")][1] == pytest.approx((2, 2.2 / 9.0, 2.2 / 10.0, 2.2 / 8.0))
    assert series[("tiny", "stock")][0][:2] == (1, pytest.approx(2.0 / 1.8))
    points = plots.cluster_points(json.loads(cluster.read_text()))
    assert points[(2, 25.0, "mlp", "powersgd")] == {"step": 40.0, "wire": 1.0, "hidden": 0.0,
                                                    "predicted/measured": 0.85}
    assert len(points) == 4  # the target rows are not configurations
    logged = []
    written = plots.make_plots(multiworker=str(multiworker), cluster=str(cluster),
                               out_dir=str(tmp_path / "out"), log=logged.append)
    assert [p.rsplit("/", 1)[1] for p in written] == [
        "efficiency.png", "link_step.png", "predicted_vs_measured.png"]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == PNG
    assert len(logged) == 3


def test_missing_inputs_are_skipped_and_a_wrong_file_is_a_clear_error(tmp_path):
    logged = []
    assert plots.make_plots(multiworker=str(tmp_path / "none.json"), cluster=None,
                            out_dir=str(tmp_path), log=logged.append) == []
    assert "efficiency.png skipped: no" in logged[0] and "--scaling_only" in logged[0]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="has no 'scaling': expected the --out file of "
                                         "bench_multiworker"):
        plots.make_plots(multiworker=str(wrong), cluster=None, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="has no cluster/... rows"):
        plots.make_plots(multiworker=None, cluster=str(wrong), out_dir=str(tmp_path))
    wrong.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        plots.make_plots(multiworker=str(wrong), cluster=None, out_dir=str(tmp_path))
