"""The benchmark report: module discovery (fast, fake modules) and a --quick smoke run."""

import json
import os
import subprocess
import sys

import pytest

from experiments import benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_root(tmp_path, modules):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "__init__.py").write_text("")
    for name, body in modules.items():
        (tmp_path / "experiments" / f"{name}.py").write_text(body)
    return str(tmp_path)


GOOD = """
def run(quick):
    return [{"name": "x", "value": 2.0 if quick else 1.0, "unit": "s", "target": 4.0,
             "ratio": 0.5, "note": "fake"}]
"""


def test_run_module_statuses(tmp_path):
    root = _fake_root(tmp_path, {
        "bench_good": GOOD,
        "bench_crash": "def run(quick):\n    raise RuntimeError('boom')\n",
        "bench_bad_rows": "def run(quick):\n    return [{'name': 'y'}]\n",
    })
    status, rows = benchmark.run_module("bench_good", quick=True, timeout=60, root=root)
    assert status == "ok"
    assert rows == [{"name": "x", "value": 2.0, "unit": "s", "target": 4.0, "ratio": 0.5,
                     "note": "fake", "source": "bench_good"}]
    assert benchmark.run_module("bench_missing", quick=True, timeout=60, root=root) == \
        ("not available", [])
    status, rows = benchmark.run_module("bench_crash", quick=True, timeout=60, root=root)
    assert status == "failed (exit 1): RuntimeError: boom" and rows == []
    status, rows = benchmark.run_module("bench_bad_rows", quick=True, timeout=60, root=root)
    assert status.startswith("failed: bench_bad_rows: a row must be a dict with keys name, value")


def test_check_row_rejects_non_numbers():
    with pytest.raises(ValueError,
                       match=r"m: row 'z' value must be a number\. Received: value='1'"):
        benchmark.check_row({"name": "z", "value": "1", "unit": "", "target": None,
                             "ratio": None, "note": ""}, "m")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_run_writes_the_report(tmp_path):
    out, docs = tmp_path / "results", tmp_path / "docs"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.benchmark", "--quick", f"--out_dir={out}",
         f"--docs_dir={docs}", "--modules=bench_missing_module"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "benchmark.json").read_text())
    assert report["quick"] is True
    assert report["modules"] == {"bench_presets": "ok", "bench_missing_module": "not available"}
    assert {"cpu", "cores", "tensorflow"} <= set(report["machine"])
    names = [row["name"] for row in report["rows"]]
    for expected in ("wrapper overhead", "mirrored x1", "mirrored x2", "mirrored x4",
                     "model FLOP utilisation", "all-reduce model error"):
        assert any(name.startswith(expected) for name in names), (expected, names)
    for row in report["rows"]:
        assert set(benchmark.ROW_KEYS) <= set(row)
        assert isinstance(row["value"], float) and row["value"] > 0
        if row["target"] is None:
            assert row["ratio"] is None
        else:
            assert row["ratio"] == pytest.approx(row["value"] / row["target"])
    table = (out / "benchmark.md").read_text()
    assert "| row | measured | target | ratio | note |" in table
    assert table == (docs / "benchmark.md").read_text()
    for png in report["plots"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (docs / png).exists()


def test_points_from_other_modules_validate_the_cost_model():
    from tfdist import planning

    link = planning.Link(bandwidth=1e9, latency=1e-4)
    sizes = [2**k for k in range(10, 27, 2)]
    raw = [{"bytes": k, "seconds": planning.ring_allreduce_time(k, 2, link)} for k in sizes]
    rows = [{"name": "allreduce_points", "value": 9.0, "unit": "points", "target": None,
             "ratio": None, "note": "", "source": "bench_multiworker", "points": raw},
            {"name": "other", "value": 1.0, "unit": "", "target": None, "ratio": None,
             "note": "", "source": "bench_ps"}]
    new_rows, details = benchmark.validate_points_rows(rows)
    assert "points" not in rows[0]  # moved to the details
    assert len(new_rows) == 1 and new_rows[0]["value"] < 1e-6
    assert new_rows[0]["name"].startswith("all-reduce model error on bench_multiworker's")
    assert details["bench_multiworker"]["bandwidth"] == pytest.approx(1e9)
    kept = benchmark.check_row({**rows[1], "points": [[1, 2.0]]}, "m")
    assert kept["points"] == [[1, 2.0]]
