"""Users' programs under `tfdist launch` with one parameter-server worker, against one device.

    python -m tfdist.launch --num_workers=1 --num_ps=1 --chief -- \\
        python tests/ps/run_parity_launch.py OUT_DIR [PROGRAM ...]

Every task runs this script; the worker and the ps serve inside
`make_strategy` (in their own processes). The chief runs each program of
tests/ps/parity_programs.py twice: with no strategy (one device) and under the
parameter-server strategy (one worker: every step waits for the one before,
so the run is synchronous), and prints one JSON line per program:

  {"program": ..., "one_device": {...}, "parameter_server": {...},
   "weights": max |Δw|}   (or {"program": ..., "error": "..."})

tests/ps/test_parity.py compares them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _jsonable(result: dict) -> dict:
    import numpy as np

    out = {}
    for key, value in result.items():
        if key == "weights":
            continue
        if isinstance(value, np.ndarray):
            value = value.tolist()
        out[key] = value
    return out


def main(out_dir: str, names: list[str]) -> None:
    import numpy as np

    # As a user's script does, before make_strategy: the worker's process needs the ops of
    # KerasHub's tokenizers (tensorflow_text), and there make_strategy serves for good.
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        pass
    import tfdist

    strategy = tfdist.make_strategy("parameter_server", connect_timeout=90)
    from tests.ps import parity_programs

    names = names or list(parity_programs.PROGRAMS)
    for name in names:
        program, _ = parity_programs.PROGRAMS[name]
        try:
            results = {}
            for label, chosen in (("one_device", None), ("parameter_server", strategy)):
                workdir = tempfile.mkdtemp(prefix=f"{name}-{label}-", dir=out_dir)
                results[label] = program(chosen, workdir)
            difference = max(
                float(np.max(np.abs(a - b), initial=0.0)) for a, b in
                zip(results["one_device"]["weights"], results["parameter_server"]["weights"]))
            line = {"program": name, "weights": difference,
                    **{k: _jsonable(v) for k, v in results.items()}}
        except Exception as e:  # reported per program, so one failure does not hide the rest
            line = {"program": name, "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-3000:]}
        print("PARITY " + json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
