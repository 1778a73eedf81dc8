"""Model splitting: place layers on devices, pipeline micro-batches, split layers.

    split = tfdist.split_model(model, devices=["/cpu:0", "/cpu:1"], micro_batches=8)
    split.compile("adam", "mse"); split.fit(x, y, batch_size=64)
    print(tfdist.placement_report(split))

Modules: plan (SplitPlan data, no TensorFlow),
balance (automatic and rule plans), graph (the model as a flat list of layer
calls, cut into stages), pipeline (SplitModel, split_model), one_f_one_b (the
1F1B schedule), tensor_parallel (ShardedDense), sequence_parallel, report
(placement report).
Names below load their module on first use, so `tfdist.split.SplitPlan` works
without importing TensorFlow (`tfdist.split.Plan` is its deprecated former name).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SplitPlan": "tfdist.split.plan",
    "TensorParallel": "tfdist.split.plan",
    "bubble_fraction": "tfdist.split.plan",
    "ideal_speedup": "tfdist.split.plan",
    "plan_balanced": "tfdist.split.balance",
    "plan_from_rules": "tfdist.split.balance",
    "layer_costs": "tfdist.split.balance",
    "split_model": "tfdist.split.pipeline",
    "SplitModel": "tfdist.split.pipeline",
    "split_from_options": "tfdist.split.pipeline",
    "ShardedDense": "tfdist.split.tensor_parallel",
    "placement_report": "tfdist.split.report",
    "placement_summary": "tfdist.split.report",
    "describe": "tfdist.split.report",
    "sequence_parallel": "tfdist.split.sequence_parallel",
    "SequenceParallelModel": "tfdist.split.sequence_parallel",
    "check_placement": "tfdist.split.pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name == "Plan":
        from tfdist.split import plan

        return plan.__getattr__("Plan")  # warns
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.split' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
