"""Plans, rules, balancing arithmetic, options and flags: no TensorFlow runtime needed."""

import dataclasses
import json

import pytest
from absl import flags

from tfdist import config
from tfdist import flags as tfdist_flags
from tfdist import devices
from tfdist.planning import pipeline
from tfdist.split import plan as plan_lib
from tfdist.split.plan import SplitPlan, TensorParallel


def test_canonical_device_forms():
    assert devices.canonical_device("/cpu:1") == "/device:CPU:1"
    assert devices.canonical_device("CPU:1") == "/device:CPU:1"
    assert devices.canonical_device("/device:GPU:0") == "/device:GPU:0"
    assert devices.canonical_device("/job:worker/task:1/device:CPU:0") == \
        "/job:worker/task:1/device:CPU:0"
    with pytest.raises(ValueError, match="Received: device='gpu-one'"):
        devices.canonical_device("gpu-one")


def test_plan_stages_are_runs_in_order():
    plan = SplitPlan.from_dict({"a": "/cpu:0", "b": "/cpu:0", "c": "/cpu:1", "d": "/cpu:0"})
    assert plan.stages == (("/device:CPU:0", ("a", "b")), ("/device:CPU:1", ("c",)),
                           ("/device:CPU:0", ("d",)))
    assert plan.num_stages == 3
    assert plan.devices == ("/device:CPU:0", "/device:CPU:1")
    assert plan.device_of("c") == "/device:CPU:1"


def test_plan_is_frozen_and_replace_returns_new_plan():
    plan = SplitPlan.from_dict({"a": "/cpu:0", "b": "/cpu:1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.assignments = ()
    moved = plan.replace({"b": "/cpu:0"})
    assert moved.num_stages == 1 and plan.num_stages == 2
    with pytest.raises(ValueError, match=r"not in the plan: \['zz'\]"):
        plan.replace({"zz": "/cpu:0"})


def test_plan_rejects_bad_entries():
    with pytest.raises(ValueError, match="at least one layer"):
        SplitPlan(assignments=())
    with pytest.raises(ValueError, match="appears twice"):
        SplitPlan(assignments=(("a", "/cpu:0"), ("a", "/cpu:1")))
    with pytest.raises(ValueError, match="device name"):
        SplitPlan(assignments=(("a", "cpu0"),))
    with pytest.raises(ValueError, match="not in the plan"):
        SplitPlan.from_dict({"a": "/cpu:0"},
                            tensor_parallel={"b": ("column", ["/cpu:0", "/cpu:1"])})
    with pytest.raises(ValueError, match="mode must be one of"):
        TensorParallel(mode="diagonal", devices=("/cpu:0", "/cpu:1"))
    with pytest.raises(ValueError, match=">= 2 distinct devices"):
        TensorParallel(mode="row", devices=("/cpu:0", "/cpu:0"))


def test_plan_json_round_trip(tmp_path):
    plan = SplitPlan.from_dict({"a": "/cpu:0", "b": "/cpu:1"},
                               tensor_parallel={"b": ("row", ["/cpu:1", "/cpu:2"])})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert SplitPlan.load(path) == plan
    assert json.loads(path.read_text())["format"] == "tfdist.split.Plan/1"
    (tmp_path / "bad.json").write_text('{"assignments": []}')
    with pytest.raises(ValueError, match="Not a tfdist plan"):
        SplitPlan.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not found"):
        SplitPlan.load(tmp_path / "missing.json")


def test_in_model_order_and_mismatch():
    plan = SplitPlan.from_dict({"b": "/cpu:1", "a": "/cpu:0"})
    assert plan_lib.in_model_order(plan, ["a", "b"]).layer_names == ("a", "b")
    with pytest.raises(ValueError, match=r"Layers without a device: \['c'\]"):
        plan_lib.in_model_order(plan, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"layers the model does not have: \['b'\]"):
        plan_lib.in_model_order(plan, ["a"])


def test_rules_exactly_one_match():
    names = ["enc_1", "enc_2", "dec_1", "head"]
    got = plan_lib.rules_to_assignments(names, {"^enc": "/cpu:0", "^dec|head": "/cpu:1"})
    assert dict(got) == {"enc_1": "/device:CPU:0", "enc_2": "/device:CPU:0",
                         "dec_1": "/device:CPU:1", "head": "/device:CPU:1"}
    with pytest.raises(ValueError, match=r"Ambiguous.*'enc_1' matches \['enc', '_1'\]"):
        plan_lib.rules_to_assignments(names, {"enc": "/cpu:0", "_1": "/cpu:1", "d": "/cpu:0"})
    with pytest.raises(ValueError, match=r"matching no placement rule: \['head'\]"):
        plan_lib.rules_to_assignments(names, {"enc": "/cpu:0", "dec": "/cpu:1"})
    with pytest.raises(ValueError, match=r"rules matching no layer: \['\^decoder'\]"):
        plan_lib.rules_to_assignments(names, {"enc|dec_1|head": "/cpu:0", "^decoder": "/cpu:1"})
    with pytest.raises(ValueError, match="Invalid regex"):
        plan_lib.rules_to_assignments(names, {"enc(": "/cpu:0"})


def test_balance_contiguous_is_optimal():
    # Brute force over all cut points for a small case.
    costs = [5, 1, 1, 1, 4, 2, 2]
    stages = pipeline.balance_contiguous(costs, [1, 1, 1])
    assert stages == sorted(stages) and set(stages) == {0, 1, 2}
    load = max(sum(c for c, s in zip(costs, stages) if s == k) for k in range(3))
    best = min(max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
               for i in range(1, 6) for j in range(i + 1, 7))
    assert load == best == 6


def test_balance_device_weights_give_fast_device_more():
    costs = [1.0] * 9
    stages = pipeline.balance_contiguous(costs, [2.0, 1.0])
    assert stages.count(0) == 6 and stages.count(1) == 3


def test_balance_needs_a_layer_per_stage():
    with pytest.raises(ValueError, match="Cannot split 2 layer"):
        pipeline.balance_contiguous([1, 1], [1, 1, 1])


def test_bubble_formulas():
    assert plan_lib.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert plan_lib.ideal_speedup(2, 8) == pytest.approx(16 / 9)
    assert plan_lib.bubble_fraction(4, 1) == pytest.approx(3 / 4)


def test_split_options_validation(tmp_path):
    assert not config.SplitOptions().enabled
    assert config.SplitOptions(split="auto", stages=2, micro_batches=4).enabled
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        config.SplitOptions(split="auto", micro_batches=0)
    with pytest.raises(ValueError, match="only apply when the model is split"):
        config.SplitOptions(micro_batches=4)
    with pytest.raises(ValueError, match="no such file"):
        config.SplitOptions(split=str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="split_balance must be one of"):
        config.SplitOptions(split="auto", split_balance="bytes")
    with pytest.raises(ValueError, match="schedule must be one of free, gpipe, 1f1b"):
        config.SplitOptions(split="auto", schedule="zigzag")
    with pytest.raises(ValueError, match="only apply when the model is split"):
        config.SplitOptions(schedule="gpipe")
    # The combination rules are the Parallelism's (one home), in the options' names.
    with pytest.raises(ValueError, match=r"1f1b' needs at least as many micro-batches as "
                                         r"stages.*micro_batches=2 for 4 stages"):
        config.SplitOptions(split="auto", stages=4, micro_batches=2, schedule="1f1b")


CPUS = ("/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3")


def test_split_options_describe_one_parallelism(tmp_path):
    from tfdist.parallelism import Parallelism
    from tfdist.split.plan import SplitPlan

    canon = tuple(f"/device:CPU:{i}" for i in range(4))
    auto = config.SplitOptions(split="auto", stages=2, micro_batches=4, schedule="gpipe")
    assert auto.parallelism(CPUS) == Parallelism(stages=2, micro_batches=4, schedule="gpipe",
                                                 devices=canon[:2])
    assert auto.parallelism(CPUS, replicas=2) == Parallelism(
        replicas=2, stages=2, micro_batches=4, schedule="gpipe", devices=canon)
    # Without --stages: every device of a replica.
    assert config.SplitOptions(split="auto").parallelism(CPUS).stages == 4
    assert config.SplitOptions(split="auto").parallelism(CPUS, replicas=2).stages == 2
    assert config.SplitOptions(sequence_parallel=2).parallelism(CPUS, replicas=2) == Parallelism(
        replicas=2, sequence=2, devices=canon)
    # A plan file: replica 0 on the plan's devices, the next replicas on the next devices.
    path = tmp_path / "plan.json"
    SplitPlan.from_dict({"a": "/cpu:2", "b": "/cpu:3"}).save(path)
    from_file = config.SplitOptions(split=str(path), micro_batches=2)
    assert from_file.parallelism(CPUS).devices == canon[2:]
    assert from_file.parallelism(CPUS, replicas=2).devices == canon[2:] + canon[:2]
    with pytest.raises(ValueError, match=r"stages=2 x replicas=4 needs 8 devices, but only 4 "
                                         r"are available.*--logical_devices=8"):
        auto.parallelism(CPUS, replicas=4)
    with pytest.raises(ValueError, match="1f1b' runs one pipeline"):
        config.SplitOptions(split="auto", stages=2, micro_batches=2,
                            schedule="1f1b").parallelism(CPUS, replicas=2)
    with pytest.raises(ValueError, match="split nothing"):
        config.SplitOptions().parallelism(CPUS)


def test_split_flags(tmp_path):
    fv = flags.FlagValues()
    tfdist_flags.define_split_flags(fv)
    tfdist_flags.define_split_flags(fv)  # idempotent
    fv(["prog", "--split=auto", "--stages=2", "--micro_batches=8", "--split_balance=flops"])
    opts = tfdist_flags.split_options_from_flags(fv)
    assert opts == config.SplitOptions(split="auto", stages=2, micro_batches=8,
                                       split_balance="flops")
    fv2 = flags.FlagValues()
    tfdist_flags.define_split_flags(fv2)
    fv2(["prog", "--micro_batches=4"])
    with pytest.raises(flags.ValidationError, match="--split=auto"):
        tfdist_flags.split_options_from_flags(fv2)


def test_large_inputs_use_bisection_with_the_same_optimum():
    import random

    import numpy as np

    rng = random.Random(3)
    for n, k in ((40, 3), (70, 5)):
        costs = [rng.random() for _ in range(n)]
        weights = [rng.choice([1.0, 2.0]) for _ in range(k)]
        exact = pipeline.balance_contiguous(costs, weights)
        fast = pipeline._balance_by_bisection(np.concatenate([[0.0], np.cumsum(costs)]), weights)

        def load(stages, costs=costs, weights=weights, k=k):
            return max(sum(c for c, s in zip(costs, stages) if s == j) / weights[j]
                       for j in range(k))

        assert fast == sorted(fast) and set(fast) == set(range(k))
        assert load(fast) == pytest.approx(load(exact), rel=1e-9)
    many = pipeline.balance_contiguous([1.0] * 900, [1.0] * 64)  # bisection path
    assert set(many) == set(range(64)) and max(many.count(s) for s in range(64)) == 15


def test_sequence_parallel_option_and_flag():
    opts = config.SplitOptions(sequence_parallel=2)
    assert opts.enabled and opts.split == "none"
    with pytest.raises(ValueError, match=r"sequence_parallel must be an integer >= 1\. "
                                         r"Received: sequence_parallel=0"):
        config.SplitOptions(sequence_parallel=0)
    with pytest.raises(ValueError, match=r"Sequence parallelism and a pipeline .* are separate"
                                         r".*Received: sequence_parallel=2"):
        config.SplitOptions(split="auto", sequence_parallel=2)
    fv = flags.FlagValues()
    tfdist_flags.define_split_flags(fv)
    fv(["prog", "--sequence_parallel=4"])
    assert tfdist_flags.split_options_from_flags(fv).sequence_parallel == 4
