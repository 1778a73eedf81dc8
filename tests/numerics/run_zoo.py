"""The KerasHub zoo under `mirrored` x2 against one device, in one fresh process.

    python tests/numerics/run_zoo.py [--families GPT2,ViT,...] [--unfixed] [--shard parameters]

For each family (tests/zoo.py): the same initial weights, 3 steps at global
batch 8 (2 logical CPUs), and

- sgd: `mirrored` with SGD vs one device with SGD (all variables);
- sgd_sync (BatchNorm families): `mirrored` with `sync_batch_norm=True`;
- adam / adam_embedding (families with an embedding): `mirrored` with Adam
  vs one device with Adam on summed sparse gradients
  (`tfdist.sum_duplicate_sparse_gradients`), over all variables and over the
  embedding tables only (Adam turns rounding noise on
  variables whose true gradient is 0 into steps of up to lr, so the sparse
  fix is judged on the tables);
- spread: the largest difference between the two replicas' copies.

`--unfixed` uninstalls tfdist's optimizer-update and BatchNorm fixes first
(the issue's baseline). `--shard parameters` (or optimizer, gradients) runs
the distributed side with ZeRO sharding of every variable. Prints one
`ROW {json}` line per family and a `COUNTS {json}` line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GLOBAL_BATCH, STEPS = 8, 3
TOLERANCE_SGD, TOLERANCE_ADAM = 1e-5, 1e-4


def _fit(strategy, family, initial, data, *, optimizer, summed=False):
    import keras

    import tfdist

    with strategy.scope():
        model = family.build(seed=0)
        model.set_weights(initial)
        opt = (keras.optimizers.SGD(0.01) if optimizer == "sgd"
               else keras.optimizers.Adam(1e-3))
        if summed:
            tfdist.sum_duplicate_sparse_gradients(opt)
        model.compile(opt, "mse")
    model.fit(*data, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    return model


def _difference(a, b, only=None) -> float:
    import numpy as np

    worst = 0.0
    for u, v in zip(a.weights, b.weights):
        if only is not None and not only(u.path):
            continue
        d = np.abs(np.asarray(u.numpy(), np.float64) - np.asarray(v.numpy(), np.float64))
        worst = max(worst, float(d.max()) if d.size else 0.0)
    return worst


def _is_embedding_table(path: str) -> bool:
    return "embedding" in path.lower()


def measure(family, one, mirrored, synced, *, unfixed=False,
            measures=("sgd", "adam")) -> dict:
    def distributed_fit(strategy, **kwargs):
        if unfixed:  # the reference's opt-in reinstalls the update hook: remove it again
            from tfdist.compat import _patch

            _patch.uninstall()
        return _fit(strategy, family, initial, data, **kwargs)

    initial = family.build(seed=0).get_weights()
    data = family.batch(GLOBAL_BATCH * STEPS, seed=0)
    row: dict = {"family": family.name, "tags": sorted(family.tags)}
    if "sgd" in measures:
        _measure_sgd(row, family, initial, data, one, mirrored, synced, distributed_fit)
    if "adam" in measures and "embedding" in family.tags:  # judged on embedding tables
        _measure_adam(row, family, initial, data, one, mirrored, distributed_fit)
    return row


def _measure_sgd(row, family, initial, data, one, mirrored, synced, distributed_fit):
    import tfdist

    reference = _fit(one, family, initial, data, optimizer="sgd")
    distributed = distributed_fit(mirrored, optimizer="sgd")
    row["sgd"] = _difference(distributed, reference)
    row["spread"] = tfdist.replica_spread(distributed)
    if "batchnorm" in family.tags:
        row["sgd_sync"] = _difference(distributed_fit(synced, optimizer="sgd"), reference)


def _measure_adam(row, family, initial, data, one, mirrored, distributed_fit):
    reference = _fit(one, family, initial, data, optimizer="adam", summed=True)
    distributed = distributed_fit(mirrored, optimizer="adam")
    row["adam"] = _difference(distributed, reference)
    if any(_is_embedding_table(v.path) for v in reference.weights):
        row["adam_embedding"] = _difference(distributed, reference, only=_is_embedding_table)


def counts(rows: list[dict]) -> dict:
    """The issue's counts over ROW dicts (from one or several runs)."""
    built = [r for r in rows if "error" not in r]
    adam = [r for r in built if "adam" in r]
    built = [r for r in built if "sgd" in r] if any("sgd" in r for r in built) else []
    sgd = [r for r in built if r["sgd"] <= TOLERANCE_SGD]
    sgd_or_sync = [r for r in built
                   if min(r["sgd"], r.get("sgd_sync", float("inf"))) <= TOLERANCE_SGD]
    with_tables = [r for r in adam if "adam_embedding" in r]
    return {
        "families": len(rows),
        "built": len(built),
        "sgd_equal": len(sgd),
        "sgd_equal_with_sync_batch_norm": len(sgd_or_sync),
        "sgd_differs": sorted(r["family"] for r in built if r not in sgd_or_sync),
        "adam_measured": len(adam),
        "adam_equal_all_variables": sum(r["adam"] <= TOLERANCE_ADAM for r in adam),
        "with_embedding_tables": len(with_tables),
        "adam_embedding_tables_equal": sum(r["adam_embedding"] <= TOLERANCE_ADAM
                                           for r in with_tables),
        "max_replica_spread": max((r["spread"] for r in built), default=0.0),
        "adam_embedding_tables_differ": sorted(r["family"] for r in with_tables
                                               if r["adam_embedding"] > TOLERANCE_ADAM),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="", help="comma-separated names (default: all)")
    parser.add_argument("--measure", default="sgd,adam", help="sgd, adam or both")
    parser.add_argument("--moe_aux_loss_zero", action="store_true",
                        help="MoE families with their load-balancing loss coefficient at 0")
    parser.add_argument("--unfixed", action="store_true",
                        help="uninstall tfdist's optimizer-update and BatchNorm fixes")
    parser.add_argument("--shard", default="none",
                        help="the distributed runs shard their state (optimizer, gradients or "
                             "parameters: ZeRO-1/2/3), every variable (shard_min_bytes=0)")
    args = parser.parse_args()

    import tfdist

    tfdist.configure_logical_devices(2)
    import tensorflow as tf

    from tests import zoo

    if not zoo.AVAILABLE:
        print("SKIP " + zoo.SKIP_REASON)
        return
    one = tf.distribute.get_strategy()
    sharding = ({"shard": args.shard, "shard_min_bytes": 0} if args.shard != "none" else {})
    mirrored = tfdist.make_strategy("mirrored", num_devices=2, **sharding)
    synced = tfdist.make_strategy("mirrored", num_devices=2, sync_batch_norm=True, **sharding)
    names = [n for n in args.families.split(",") if n] or list(zoo.FAMILIES)
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            family = zoo.FAMILIES[name]
            if args.moe_aux_loss_zero and name in zoo.MOE_AUX_LOSS_ARGUMENT:
                family = family.with_config(**{zoo.MOE_AUX_LOSS_ARGUMENT[name]: 0.0})
            row = measure(family, one, mirrored, synced, unfixed=args.unfixed,
                          measures=tuple(args.measure.split(",")))
        except Exception as e:  # a family that fails is counted, not fatal
            row = {"family": name, "error": f"{type(e).__name__}: {e}"[:300]}
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    print("COUNTS " + json.dumps(counts(rows)), flush=True)


if __name__ == "__main__":
    main()
