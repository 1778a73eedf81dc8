"""The corpus of users' programs: every cell (program x preset) as expected.json says.

Per push, `corpus.PUSH_SUBSET` runs (one program per kind of result the corpus shows, the
cheapest of each) under one device, `mirrored` x2, two workers and `parameter_server`;
`TFDIST_FULL_CORPUS=1` runs every program (the release run; durations in docs/programs.md).
A cell that now fails and a cell that now passes both fail the test, so neither a regression
nor a fix goes unrecorded, and docs/programs.md's table must agree with the expectations.
The other tests here check the comparison itself, on made-up records.
"""

from __future__ import annotations

import ast
import json
import os
import re

import numpy as np
import pytest

from tests.support import REPO, run_python
from tests.programs import corpus, run_corpus

FULL = os.environ.get("TFDIST_FULL_CORPUS") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.timeout(5400 if FULL else 900)
def test_corpus_cells_are_as_expected(tmp_path):
    out = tmp_path / "corpus"
    proc = run_python("-m", "tests.programs.run_corpus", f"--subset={'all' if FULL else 'push'}",
                      f"--out={out}", f"--check={run_corpus.EXPECTED}",
                      timeout=5300 if FULL else 840)
    mismatches = re.findall(r"^corpus: MISMATCH (.*)$", proc.stdout, re.MULTILINE)
    assert proc.returncode == 0, ("\n".join(mismatches) or proc.stdout[-4000:]) + \
        "\n" + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    expected_programs = corpus.PROGRAMS if FULL else corpus.PUSH_SUBSET
    assert list(results) == list(expected_programs)
    columns = run_corpus.COLUMNS if FULL else run_corpus.PUSH_COLUMNS
    assert all(set(row) == {run_corpus.REFERENCE, *columns} for row in results.values())


def _docs_cells() -> dict:
    """{program: {preset: result}} read back from docs/programs.md's table symbols."""
    with open(run_corpus.DOCS) as f:
        text = f.read()
    table = text[text.index(run_corpus.TABLE_START):text.index(run_corpus.TABLE_END)]
    symbols = {"✓": "pass", "≠": "differs", "✗": "failed"}
    cells = {}
    for line in table.splitlines():
        match = re.match(r"\| \[(\w+)\]\(", line)
        if not match:
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        cells[match.group(1)] = {preset: symbols[part[0]]
                                 for preset, part in zip(run_corpus.COLUMNS, parts[2:])}
    return cells


def test_docs_table_agrees_with_the_expectations():
    expected = json.load(open(run_corpus.EXPECTED))
    docs = _docs_cells()
    assert list(docs) == list(corpus.PROGRAMS)
    for program, row in docs.items():
        for preset, result in row.items():
            assert result in run_corpus.allowed_results(expected[program][preset]), \
                (program, preset)
    assert all(run_corpus.expected_result(expected[p][run_corpus.REFERENCE]) == "pass"
               for p in corpus.PROGRAMS)


def test_every_program_says_where_it_comes_from_and_what_changed():
    files = sorted(name[:-3] for name in os.listdir(HERE)
                   if name.endswith(".py") and not name.startswith(("_", "test_", "run_"))
                   and name != "corpus.py")
    assert sorted(corpus.PROGRAMS) == files
    assert len(corpus.PROGRAMS) >= 20 and set(corpus.PUSH_SUBSET) <= set(corpus.PROGRAMS)
    for name in files:
        with open(os.path.join(HERE, f"{name}.py")) as f:
            tree = ast.parse(f.read())
        doc = ast.get_docstring(tree)
        assert doc and "Source: https://github.com/keras-team/" in doc, name
        assert "Changed: " in doc, name
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "main" in functions, name
        assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert {"SOURCE", "COMPARE"} <= assigned, name


# ---------------------------------------------------------------------------------------
# The comparison, on made-up records (no program runs).

W = [np.array([1.0, 2.0], "float32"), np.array([[0.5]], "float32")]


def _record(**changes):
    record = {"status": "finished", "seconds": 1.0, "losses": [0.9, 0.5], "trend": [0.9, 0.5],
              "checks": {}, "iterations": [4], "spread": 0.0}
    record.update(changes)
    return record


def test_an_exact_program_passes_within_its_tolerance_and_differs_beyond():
    exact = corpus.Exact(weights=1e-5, loss=1e-5)
    near = [w + 1e-6 for w in W]
    cell = run_corpus.judge(_record(), _record(), exact, mine=near, theirs=W)
    assert cell["result"] == "pass" and 0 < cell["weights"] <= 1e-5
    # Negative controls: a weight, a logged loss, a replica's copy, a program's own check.
    far = [W[0] + 1e-3, W[1]]
    assert run_corpus.judge(_record(), _record(), exact, mine=far, theirs=W)["result"] == "differs"
    halved = _record(losses=[0.45, 0.25])
    assert "Δloss" in run_corpus.judge(halved, _record(), exact, mine=W, theirs=W)["why"]
    assert "copies" in run_corpus.judge(_record(spread=1e-3), _record(), exact, mine=W,
                                    theirs=W)["why"]
    assert "check" in run_corpus.judge(_record(checks={"reload": 0.1}), _record(), exact, mine=W,
                                   theirs=W)["why"]
    assert run_corpus.judge(_record(), _record(), exact, mine=W[:1], theirs=W)["weights"] == np.inf
    other = [W[0] + 1e-3, W[1]]
    assert "copies" in run_corpus.judge(_record(spread=None), _record(), exact, mine=W, theirs=W,
                                    other_worker=other)["why"]


def test_a_property_program_needs_finite_values_its_trend_and_the_same_step_count():
    prop = corpus.Property(reason="dropout")
    far = [w + 0.5 for w in W]
    assert run_corpus.judge(_record(), _record(), prop, mine=far, theirs=W)["result"] == "pass"
    rising = _record(trend=[0.5, 0.9])
    assert "not falling" in run_corpus.judge(rising, _record(), prop, mine=W, theirs=W)["why"]
    nan = [np.array([np.nan, 1.0], "float32"), W[1]]
    assert "finite" in run_corpus.judge(_record(), _record(), prop, mine=nan, theirs=W)["why"]
    assert "steps" in run_corpus.judge(_record(iterations=[2]), _record(), prop, mine=W,
                                   theirs=W)["why"]
    accuracy = corpus.Property(reason="dropout", trend="rising")
    assert run_corpus.judge(rising, _record(), accuracy, mine=W, theirs=W)["result"] == "pass"
    with pytest.raises(ValueError, match="trend must be"):
        corpus.Property(reason="x", trend="up")


def test_asynchronous_workers_are_judged_by_what_they_must_keep():
    exact = corpus.Exact()
    far = [w + 0.5 for w in W]
    ok = run_corpus.judge(_record(trend=[0.5, 0.9]), _record(), exact, mine=far, theirs=W,
                          asynchronous=True)
    assert ok["result"] == "pass"
    lost = run_corpus.judge(_record(iterations=[3]), _record(), exact, mine=far, theirs=W,
                            asynchronous=True)
    assert "steps [3] != one device's [4]" in lost["why"]
    assert run_corpus.judge(_record(checks={"reload": 1.0}), _record(), exact, mine=W,
                            theirs=W, asynchronous=True)["result"] == "differs"


def test_a_failed_run_keeps_its_error():
    failed = {"status": "failed", "error": "TypeError: boom", "seconds": 2.0}
    cell = run_corpus.judge(failed, _record(), corpus.Exact(), mine=None, theirs=W)
    assert cell == {"seconds": 2.0, "result": "failed", "error": "TypeError: boom"}


def test_check_fails_on_a_regression_and_on_an_unexpected_fix():
    results = {"p": {"one_device": {"result": "pass"}, "mirrored": {"result": "failed",
                                                                      "error": "E: x"},
                     "parameter_server": {"result": "pass"}}}
    expected = {"p": {"one_device": "pass", "mirrored": "pass",
                      "parameter_server": {"result": "failed", "cause": "refused"}}}
    problems = run_corpus.check(results, expected)
    assert len(problems) == 2
    assert any("mirrored: expected pass, got failed (regressed): E: x" in p for p in problems)
    assert any("parameter_server: expected failed, got pass (better than expected" in p
               for p in problems)
    assert run_corpus.check(results, {"p": {"one_device": "pass", "mirrored": "failed",
                                            "parameter_server": "pass"}}) == []
    assert "no entry" in run_corpus.check(results, {"p": {}})[0]
    # A cell that varies from run to run allows its results; a failure names its error.
    varies = {"p": {"one_device": "pass", "mirrored": {"result": ["failed", "pass"]},
                    "parameter_server": "pass"}}
    assert run_corpus.check(results, varies) == []
    other = {"p": {"one_device": "pass", "mirrored": {"result": "failed", "error": "E: y"},
                   "parameter_server": "pass"}}
    assert "fails for another reason" in run_corpus.check(results, other)[0]
    other["p"]["mirrored"]["error"] = "E: x"
    assert run_corpus.check(results, other) == []


def test_two_workers_merge_into_one_record():
    done = {"p": {"program": "p", "status": "finished", "seconds": 3.0}}
    failed = {"p": {"program": "p", "status": "failed", "error": "E", "seconds": 1.0}}
    assert run_corpus._merge_workers("p", [done, done], 0)["status"] == "finished"
    assert run_corpus._merge_workers("p", [done, failed], 3)["error"] == "E"
    assert "worker 1 left no result" in run_corpus._merge_workers("p", [done, {}], 137)["error"]
    assert run_corpus._merge_workers("p", [{}, {}], 137) is None


def test_error_line_skips_tensorflow_boilerplate():
    from tests.programs.run_preset import error_line

    exc = ValueError("Graph execution error:\n\nDetected at node Foo defined at:\n"
                     "  File \"x.py\", line 1\nValue for attr 'T' of string is not allowed")
    assert error_line(exc) == "ValueError: Value for attr 'T' of string is not allowed"
    assert error_line(KeyError("loss")) == "KeyError: 'loss'"
    bf16 = ValueError("Value for attr 'T' of bfloat16 is not in the list\n\t; NodeDef: "
                      "{{node CollectiveBcastSend}}; Op<name=CollectiveBcastSend> "
                      "[Op:CollectiveBcastSend]")
    assert error_line(bf16) == ("ValueError: Value for attr 'T' of bfloat16 is not in the list "
                                "(op CollectiveBcastSend)")
    assert len(error_line(RuntimeError("x" * 500))) == 220


def test_the_corpus_refuses_an_unknown_program_or_preset():
    proc = run_python("-m", "tests.programs.run_corpus", "--programs=no_such_program",
                      "--presets=one_device", timeout=120)
    assert proc.returncode == 2 and "unknown programs ['no_such_program']" in proc.stderr
    proc = run_python("-m", "tests.programs.run_corpus", "--presets=one_device,tpu",
                      timeout=120)
    assert proc.returncode == 2 and "unknown presets ['tpu']" in proc.stderr


def test_the_docs_link_and_describe_the_corpus():
    with open(os.path.join(REPO, "README.md")) as f:
        assert "docs/programs.md" in f.read()
    with open(run_corpus.DOCS) as f:
        text = f.read()
    assert "python -m tests.programs.run_corpus" in text and "TFDIST_FULL_CORPUS=1" in text
