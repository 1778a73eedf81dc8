"""The corpus of users' programs under tfdist's presets: run, compare with one device, render.

    python -m tests.programs.run_corpus                     # every program, every preset
    python -m tests.programs.run_corpus --programs=endpoint_layer,vae_train_step
    python -m tests.programs.run_corpus --subset=push       # what CI runs on every push
    python -m tests.programs.run_corpus --out=/tmp/corpus --markdown=/tmp/corpus/table.md
    python -m tests.programs.run_corpus --docs              # also rewrite docs/programs.md's table
    python -m tests.programs.run_corpus --record            # and tests/programs/expected.json

Each preset runs in its own process (TensorFlow imported once), all programs one after
another (tests/programs/run_preset.py): `one_device` (the reference: TensorFlow's default
strategy, no distribution, on the same 2 logical CPUs), `mirrored` (2 logical CPUs),
`multi_worker_mirrored` (2 workers under `python -m tfdist.launch --num_workers=2`, one
launch running every program), `parameter_server` (the in-process cluster with 1 worker and
1 ps: steps run in order, so it must equal one device) and `parameter_server_async` (2
workers, 1 ps). After a failure a fresh process takes the programs left.

Each cell (program x preset) is then one of
  pass      finished, and equal to one device (programs with COMPARE = Exact: final weights
            and logged losses within the stated tolerance) or showing the stated property
            (COMPARE = Property: finite, falling loss, the same step count); the program's
            own checks (reloaded files, ...) within CHECK_TOLERANCE; replicas' and workers'
            copies identical (<= 1e-6). Under `parameter_server_async` every program is
            judged as asynchronous training: finite values, the same step count, its checks.
  differs   finished, but not that.
  failed    raised (the first error line is kept) or ran past its time limit.

Writes OUT/results.json and OUT/table.md. `--check FILE` compares every cell's result with
FILE's (tests/programs/expected.json) and exits 1 listing each difference, in both
directions: a cell that now fails and a cell that now passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.programs import corpus  # noqa: E402

REFERENCE = "one_device"
COLUMNS = ("mirrored", "multi_worker_mirrored", "parameter_server", "parameter_server_async")
COLUMN_TITLES = {"mirrored": "mirrored ×2", "multi_worker_mirrored": "two workers",
                 "parameter_server": "parameter_server, 1 worker",
                 "parameter_server_async": "parameter_server, 2 workers (async)"}
# Asynchronous training is not deterministic: every program there is judged by what
# asynchronous workers must keep (see `judge`).
ASYNCHRONOUS = ("parameter_server_async",)
# What runs on every push (with corpus.PUSH_SUBSET); the asynchronous column runs in full runs.
PUSH_COLUMNS = ("mirrored", "multi_worker_mirrored", "parameter_server")
SPREAD_TOLERANCE = 1e-6
EXPECTED = os.path.join(REPO, "tests", "programs", "expected.json")
DOCS = os.path.join(REPO, "docs", "programs.md")
TABLE_START, TABLE_END = "<!-- corpus-table:start -->", "<!-- corpus-table:end -->"


# ---------------------------------------------------------------------------------------
# Running


def _read_records(path: str) -> dict:
    records = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    records[entry["program"]] = entry
    return records


def _merge_workers(program: str, per_worker: list[dict], returncode: int) -> dict | None:
    """One record from each worker's record of `program` (None: neither has one)."""
    entries = [r.get(program) for r in per_worker]
    if all(e is None for e in entries):
        return None
    bad = [e for e in entries if e is not None and e["status"] != "finished"]
    if bad:
        return bad[0]
    if any(e is None for e in entries):
        missing = [i for i, e in enumerate(entries) if e is None]
        return {"program": program, "status": "failed", "seconds": entries[0]["seconds"] if
                entries[0] else 0.0,
                "error": f"worker {missing[0]} left no result (launch exit status {returncode})"}
    return entries[0]


def run_preset(preset: str, programs: list[str], out: str, *, program_timeout: float,
               log) -> dict:
    """Runs `programs` under `preset` until each has a record; returns {program: record}."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KERAS_BACKEND="tensorflow")
    records: dict = {}
    remaining = list(programs)
    while remaining:
        runner = [sys.executable, "-m", "tests.programs.run_preset", f"--preset={preset}",
                  f"--programs={','.join(remaining)}", f"--out={out}",
                  f"--timeout={program_timeout:g}"]
        # The launch as a whole: the programs' limits plus start-up, never unbounded.
        overall = program_timeout * len(remaining) + 120
        if preset == "multi_worker_mirrored":
            command = [sys.executable, "-m", "tfdist.launch", "--num_workers=2",
                       f"--timeout={overall:g}", "--grace_period=3", "--", *runner]
            logs = [os.path.join(out, f"{preset}.worker{i}.jsonl") for i in (0, 1)]
        else:
            command = runner
            logs = [os.path.join(out, f"{preset}.jsonl")]
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        try:
            returncode = subprocess.run(command, cwd=REPO, env=env, stdout=log, check=False,
                                        stderr=subprocess.STDOUT, timeout=overall + 60
                                        ).returncode
        except subprocess.TimeoutExpired:
            returncode = 124
        per_worker = [_read_records(path) for path in logs]
        progressed = False
        for program in list(remaining):
            entry = _merge_workers(program, per_worker, returncode)
            if entry is None:
                break
            records[program] = entry
            remaining.remove(program)
            progressed = True
        if not progressed and remaining:
            # The process ended before recording anything: blame the program it was on.
            records[remaining[0]] = {
                "program": remaining[0], "status": "failed", "seconds": 0.0,
                "error": f"the process exited with status {returncode} and no result "
                         f"(see {os.path.basename(log.name)})"}
            remaining.pop(0)
    return records


# ---------------------------------------------------------------------------------------
# Comparing


def _weights(out: str, preset: str, program: str, suffix: str = ""):
    import numpy as np

    path = os.path.join(out, preset, f"{program}{suffix}.npz")
    if not os.path.exists(path):
        return None
    with np.load(path) as data:
        return [data[k] for k in sorted(data.files)]


def _max_difference(a, b) -> float:
    """Largest |a - b| over two lists of arrays (inf when their structure differs)."""
    import numpy as np

    if a is None or b is None or len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return math.inf
        if x.size == 0:
            continue
        if x.dtype.kind in "fc" or y.dtype.kind in "fc":
            d = np.abs(x.astype("float64") - y.astype("float64"))
            if not np.all(np.isfinite(d)):
                return math.inf
            worst = max(worst, float(d.max()))
        elif not np.array_equal(x, y):
            return math.inf
    return worst


def _loss_difference(a, b) -> float:
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def judge(record: dict, reference: dict, compare, *, mine, theirs, other_worker=None,
          asynchronous: bool = False) -> dict:
    """One cell: its result, the differences from one device, and why it is not a pass.

    Args:
      record: the preset's record of the program (from the runner).
      reference: the one-device record of the same program.
      compare: the program's COMPARE (`corpus.Exact` or `corpus.Property`).
      mine, theirs: the final weights under the preset and on one device (lists of arrays).
      other_worker: the second worker's final weights (two-worker runs), else None.
      asynchronous: judge every program as asynchronous workers train it: finite logged
        values and weights, as many optimizer steps as on one device, the program's own
        checks; no trend (several models' losses in a row have none) and no equality.
    """
    import numpy as np

    cell = {"seconds": round(record.get("seconds", 0.0), 1)}
    if record["status"] != "finished":
        cell.update(result="failed", error=record.get("error", ""))
        if record.get("traceback"):
            cell["traceback"] = record["traceback"]
        return cell
    d_weights = _max_difference(mine, theirs)
    d_loss = _loss_difference(record["losses"], reference["losses"])
    spread = record.get("spread")
    if other_worker is not None:
        spread = _max_difference(mine, other_worker)
    cell.update(weights=d_weights, loss=d_loss, spread=spread)
    problems = []
    for name, value in record["checks"].items():
        if not value <= corpus.CHECK_TOLERANCE:
            problems.append(f"check {name} = {value:.3g} > {corpus.CHECK_TOLERANCE:g}")
    if spread is not None and not spread <= SPREAD_TOLERANCE:
        problems.append(f"copies differ by {spread:.3g}")
    if asynchronous:
        compare = corpus.Property(reason="asynchronous workers", trend=None)
    if isinstance(compare, corpus.Exact):
        if not d_weights <= compare.weights:
            problems.append(f"|Δw| {d_weights:.3g} > {compare.weights:g}")
        if not d_loss <= compare.loss:
            problems.append(f"|Δloss| {d_loss:.3g} > {compare.loss:g}")
    else:
        if not (corpus.finite(record["losses"]) and mine is not None
                and all(np.all(np.isfinite(w)) for w in mine if w.dtype.kind == "f")):
            problems.append("a loss or weight is not finite")
        trend = record.get("trend") or []
        if compare.trend and not (len(trend) >= 2 and (
                trend[-1] < trend[0] if compare.trend == "falling" else trend[-1] > trend[0])):
            problems.append(f"not {compare.trend} ({trend[0]:.4g} -> {trend[-1]:.4g})"
                            if trend else "nothing logged")
        if record["iterations"] != reference["iterations"]:
            problems.append(f"steps {record['iterations']} != one device's "
                            f"{reference['iterations']}")
    cell["result"] = "differs" if problems else "pass"
    if problems:
        cell["why"] = "; ".join(problems)
    return cell


def compare_all(programs, presets, records, out) -> dict:
    """{program: {preset: cell}} for every program and preset (the reference included)."""
    results = {}
    reference = records[REFERENCE]
    for program in programs:
        ref = reference[program]
        row = {REFERENCE: ({"result": "pass", "seconds": round(ref["seconds"], 1)}
                           if ref["status"] == "finished" else
                           {"result": "failed", "error": ref.get("error", ""),
                            "traceback": ref.get("traceback", "")})}
        compare = _compare_of(program)
        for preset in presets:
            if preset == REFERENCE:
                continue
            if ref["status"] != "finished":
                row[preset] = {"result": "failed", "error": "the one-device reference failed"}
                continue
            two = preset == "multi_worker_mirrored"
            row[preset] = judge(
                records[preset][program], ref, compare,
                mine=_weights(out, preset, program, ".worker0" if two else ""),
                theirs=_weights(out, REFERENCE, program),
                other_worker=_weights(out, preset, program, ".worker1") if two else None,
                asynchronous=preset in ASYNCHRONOUS)
        results[program] = row
    return results


# ---------------------------------------------------------------------------------------
# Rendering


def _number(x) -> str:
    if x is None:
        return "-"
    if x == math.inf:
        return "∞"
    return "0" if x == 0 else f"{x:.1e}"


def _note(footnotes: list, text: str) -> int:
    """The footnote number of `text` (identical notes share one number)."""
    if text not in footnotes:
        footnotes.append(text)
    return footnotes.index(text) + 1


def _cell_text(compare, cell: dict, footnotes: list, cause: str = "", *,
               asynchronous: bool = False) -> str:
    if cell["result"] == "failed":
        return f"✗ failed [{_note(footnotes, cause or cell.get('error', ''))}]"
    if isinstance(compare, corpus.Exact) and not asynchronous:
        numbers = f"Δw {_number(cell.get('weights'))}, Δloss {_number(cell.get('loss'))}"
    else:
        numbers = f"Δloss {_number(cell.get('loss'))}"
    if cell["result"] == "pass":
        return f"✓ {numbers}"
    return f"≠ differs [{_note(footnotes, cause or cell.get('why', ''))}]: {numbers}"


def _compare_of(program: str):
    import importlib

    return importlib.import_module(f"tests.programs.{program}").COMPARE


def _source_of(program: str) -> str:
    import importlib

    return importlib.import_module(f"tests.programs.{program}").SOURCE


def counts(results: dict, presets) -> dict:
    out = {}
    for preset in presets:
        cells = [row[preset] for row in results.values() if preset in row]
        out[preset] = {"cells": len(cells),
                       "finished": sum(c["result"] != "failed" for c in cells),
                       "pass": sum(c["result"] == "pass" for c in cells)}
    return out


def _compared_by(compare) -> str:
    if isinstance(compare, corpus.Exact):
        return f"equal (Δw ≤ {compare.weights:g}, Δloss ≤ {compare.loss:g})"
    trend = f", {compare.trend}" if compare.trend else ""
    return f"property: finite{trend} ({compare.reason})"


def render(results: dict, presets, *, expected: dict | None = None) -> str:
    """The markdown table: program x preset, with footnotes for every cell that is not a pass.

    `expected`: the expectations; a cell whose result (and error) its entry explains is
    footnoted with the entry's cause instead of the bare error or difference.
    """
    expected = expected or {}
    columns = [p for p in presets if p != REFERENCE]
    footnotes: list = []
    lines = ["| program | compared by | " + " | ".join(COLUMN_TITLES.get(p, p) for p in columns)
             + " |", "|---|---|" + "---|" * len(columns)]
    for program, row in results.items():
        compare = _compare_of(program)
        name = f"[{program}]({_source_of(program)})"
        if row[REFERENCE]["result"] != "pass":
            name += f" (one device failed [{_note(footnotes, row[REFERENCE].get('error', ''))}])"
        cells = []
        for p in columns:
            if p not in row:
                cells.append("-")
                continue
            entry = expected.get(program, {}).get(p)
            cause = entry.get("cause", "") if explains(entry, row[p]) else ""
            cells.append(_cell_text(compare, row[p], footnotes, cause,
                                    asynchronous=p in ASYNCHRONOUS))
        lines.append(f"| {name} | {_compared_by(compare)} | " + " | ".join(cells) + " |")
    summary = counts(results, columns)
    lines.append("| **finished / equal to one device** | | " + " | ".join(
        f"**{summary[p]['finished']}/{summary[p]['cells']} / {summary[p]['pass']}**"
        for p in columns) + " |")
    if footnotes:
        lines.append("")
        lines += [f"{i}. {note}" for i, note in enumerate(footnotes, 1)]
    return "\n".join(lines) + "\n"


def allowed_results(entry) -> tuple:
    """The results an expectations entry allows.

    An entry is "pass" / "differs" / "failed", or a dict with "result" (one of those, or a
    list of them for a cell that varies from run to run, with the reason in "cause") and
    optionally "cause" and "error" (text the cell's error line must contain).
    """
    result = entry["result"] if isinstance(entry, dict) else entry
    return tuple(result) if isinstance(result, list) else (result,)


def explains(entry, cell: dict) -> bool:
    """True if the expectations entry describes this cell: its result, and its error if named."""
    if not isinstance(entry, dict) or cell["result"] not in allowed_results(entry):
        return False
    return cell["result"] != "failed" or entry.get("error", "") in cell.get("error", "")


def check(results: dict, expected: dict) -> list[str]:
    """Every cell whose result is not an expected one (in both directions), or that fails
    with another error than its expectation names."""
    problems = []
    for program, row in results.items():
        for preset, cell in row.items():
            entry = expected.get(program, {}).get(preset)
            if entry is None:
                problems.append(f"{program} under {preset}: {cell['result']}, and the "
                                "expectations have no entry for it")
                continue
            allowed = allowed_results(entry)
            detail = cell.get("error") or cell.get("why") or ""
            if cell["result"] not in allowed:
                better = _RANK[cell["result"]] > max(_RANK[r] for r in allowed)
                direction = ("better than expected: record it with `python -m "
                             "tests.programs.run_corpus --record --docs`" if better
                             else "regressed")
                problems.append(f"{program} under {preset}: expected {'/'.join(allowed)}, got "
                                f"{cell['result']} ({direction}){': ' + detail if detail else ''}")
            elif cell["result"] == "failed" and not explains(entry, cell) and \
                    isinstance(entry, dict) and entry.get("error"):
                problems.append(f"{program} under {preset}: fails for another reason than "
                                f"expected ({entry['error']!r} not in the error): {detail}")
    return problems


_RANK = {"failed": 0, "differs": 1, "pass": 2}


def write_docs_table(markdown: str, path: str = DOCS) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    text = text[:start + len(TABLE_START)] + "\n" + markdown + text[end:]
    with open(path, "w") as f:
        f.write(text)


def _run(programs, presets, out, timeout) -> tuple[dict, dict]:
    records, seconds = {}, {}
    with open(os.path.join(out, "log.txt"), "a") as log:
        for preset in presets:
            start = time.monotonic()
            print(f"corpus: {preset}: {len(programs)} programs ...", flush=True)
            records[preset] = run_preset(preset, programs, out, program_timeout=timeout, log=log)
            seconds[preset] = round(time.monotonic() - start, 1)
            done = sum(r["status"] == "finished" for r in records[preset].values())
            print(f"corpus: {preset}: {done}/{len(programs)} finished in {seconds[preset]} s",
                  flush=True)
    return records, seconds


def _earlier_records(out, programs, presets) -> tuple[dict, dict]:
    """The records an earlier run left in `out` (and its durations, from its results.json)."""
    records = {}
    for preset in presets:
        if preset == "multi_worker_mirrored":
            per_worker = [_read_records(os.path.join(out, f"{preset}.worker{i}.jsonl"))
                          for i in (0, 1)]
            merged = {p: _merge_workers(p, per_worker, -1) for p in programs}
        else:
            merged = _read_records(os.path.join(out, f"{preset}.jsonl"))
        missing = [p for p in programs if merged.get(p) is None]
        if missing:
            raise SystemExit(f"corpus: {out} has no {preset} record of {missing}")
        records[preset] = merged
    seconds = {}
    if os.path.exists(os.path.join(out, "results.json")):
        seconds = _load(os.path.join(out, "results.json")).get("seconds", {})
    return records, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="", help="comma-separated (default: all)")
    parser.add_argument("--subset", choices=("all", "push"), default="all")
    parser.add_argument("--presets", default="",
                        help=f"comma-separated, from {(REFERENCE, *COLUMNS)} (default: all; "
                             f"with --subset=push: {(REFERENCE, *PUSH_COLUMNS)})")
    parser.add_argument("--out", default="")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per program")
    parser.add_argument("--markdown", default="", help="also write the table here")
    parser.add_argument("--check", default="", help="expected results (JSON) to compare with")
    parser.add_argument("--record", action="store_true",
                        help="write the results to tests/programs/expected.json")
    parser.add_argument("--docs", action="store_true", help="rewrite docs/programs.md's table")
    parser.add_argument("--rejudge", action="store_true",
                        help="run nothing: judge and render the records already in --out")
    args = parser.parse_args(argv)

    programs = ([p for p in args.programs.split(",") if p] or
                list(corpus.PUSH_SUBSET if args.subset == "push" else corpus.PROGRAMS))
    unknown = [p for p in programs if p not in corpus.PROGRAMS]
    if unknown:
        parser.error(f"unknown programs {unknown}; the corpus has {list(corpus.PROGRAMS)}")
    presets = ([p for p in args.presets.split(",") if p] or
               [REFERENCE, *(PUSH_COLUMNS if args.subset == "push" else COLUMNS)])
    if set(presets) - {REFERENCE, *COLUMNS}:
        parser.error(f"unknown presets {sorted(set(presets) - {REFERENCE, *COLUMNS})}; "
                     f"the corpus runs {[REFERENCE, *COLUMNS]}")
    if REFERENCE not in presets:
        presets.insert(0, REFERENCE)
    if args.docs and (set(programs) != set(corpus.PROGRAMS)
                      or set(presets) != {REFERENCE, *COLUMNS}):
        parser.error("--docs redraws the whole table: run every program under every preset "
                     "(no --programs, --subset or --presets)")
    if args.rejudge and not args.out:
        parser.error("--rejudge judges the records of an earlier run: give its --out")
    out = args.out or tempfile.mkdtemp(prefix="tfdist-corpus-")
    os.makedirs(out, exist_ok=True)
    if args.rejudge:
        records, seconds = _earlier_records(out, programs, presets)
    else:
        for name in os.listdir(out):
            if name.endswith(".jsonl"):
                os.remove(os.path.join(out, name))
        records, seconds = _run(programs, presets, out, args.timeout)

    results = compare_all(programs, presets, records, out)
    summary = counts(results, [p for p in presets if p != REFERENCE])
    document = {"programs": programs, "presets": presets, "seconds": seconds,
                "counts": summary, "results": results,
                "versions": _versions()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(document, f, indent=1, default=_json_default)
    markdown = render(results, presets,
                      expected=_load(EXPECTED) if os.path.exists(EXPECTED) else {})
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown)
    print(markdown)
    print(f"corpus: results in {out}/results.json; counts {json.dumps(summary)}")
    if args.record:
        expected = _load(EXPECTED) if os.path.exists(EXPECTED) else {}
        for program, row in results.items():
            for preset, cell in row.items():
                old = expected.setdefault(program, {}).get(preset)
                if explains(old, cell):
                    continue  # keep the cause written for this result
                expected[program][preset] = cell["result"]
        with open(EXPECTED, "w") as f:
            json.dump(expected, f, indent=1)
            f.write("\n")
    if args.docs:
        write_docs_table(markdown)
    if args.check:
        problems = check(results, _load(args.check))
        for problem in problems:
            print(f"corpus: MISMATCH {problem}")
        return 1 if problems else 0
    return 0


def expected_result(entry) -> str:
    """An expectations entry's result (the first one, for a cell that varies)."""
    return allowed_results(entry)[0]


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


def _versions() -> dict:
    from importlib import metadata

    versions = {}
    for name in ("tensorflow", "keras", "keras-hub"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


if __name__ == "__main__":
    sys.exit(main())
