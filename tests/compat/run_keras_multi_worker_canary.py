"""One task of the keras_multi_worker canary (test_keras_multi_worker.py), run by `tfdist launch`.

Each worker makes the multi_worker_mirrored preset, then fits a small model
three times under it:
  1. `stock`: every tfdist fix uninstalled (Keras as released);
  2. `symbolic_build_only`: only the symbolic-build fix;
  3. `fixed`: both fixes (and tfdist's optimizer hook) installed again.
It prints one line per run, `<name>: OK` or `<name>: <ErrorType>: <first line>`,
and saves the fixed run's weights to OUT/worker<i>.npy. Failures 1 and 2
happen while Keras traces (before any collective runs), so the group stays
usable for run 3.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    out_dir = sys.argv[1]
    import tfdist

    tfdist.import_tensorflow()
    import keras
    import numpy as np

    from tfdist.compat import _patch, keras_build, keras_multi_worker, optimizer_update

    strategy = tfdist.make_strategy("multi_worker_mirrored", join_timeout=120)
    task = os.environ.get("TFDIST_TASK", "") or str(strategy.cluster_resolver.task_id)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = x.sum(1, keepdims=True).astype("float32")

    def fit():
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.set_weights([np.full((4, 1), 0.5, "float32"), np.zeros(1, "float32")])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    def attempt(name):
        try:
            weights = fit()
        except Exception as e:  # noqa: BLE001 - the canary reports whatever stock Keras raises
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"{name}: {type(e).__name__}: {first[:300]}", flush=True)
            return None
        print(f"{name}: OK", flush=True)
        return weights

    tfdist.compat.uninstall()
    attempt("stock")
    _patch.install(keras_build.SYMBOLIC_BUILD_FIX)
    attempt("symbolic_build_only")
    keras_multi_worker.install()
    optimizer_update.install()
    weights = attempt("fixed")
    if weights is None:
        return 1
    np.save(os.path.join(out_dir, f"worker{task}.npy"),
            np.concatenate([w.ravel() for w in weights]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
