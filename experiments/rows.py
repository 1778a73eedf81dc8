"""Benchmark rows: the one format every experiments/bench_*.py prints and writes.

A row is {"name", "value", "unit", "target" (or None), "ratio" (value/target
or None), "note"}; experiments/benchmark.py collects them into one report.
"""

from __future__ import annotations

import json
import os


def print_rows(rows: list[dict]) -> None:
    """One aligned line per row, with the ratio to its target where it has one."""
    width = max((len(r["name"]) for r in rows), default=0)
    for r in rows:
        target = (f"  (target {r['target']:g}, ratio {r['ratio']:.2f})"
                  if r.get("target") is not None and r.get("ratio") is not None else "")
        print(f"{r['name']:<{width}} {r['value']:>12.4g} {r['unit']:<10}{target}  {r['note']}")


def write_rows(path: str, rows: list[dict], **details) -> None:
    """Writes {"rows": rows, **details} as JSON, creating the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"rows": rows, **details}, f, indent=2)


def row(name: str, value: float, unit: str, note: str = "", target: float | None = None) -> dict:
    """One row; `ratio` is value / target when there is a target."""
    return {"name": name, "value": float(value), "unit": unit, "target": target,
            "ratio": (float(value) / target) if target else None, "note": note}
