"""The planning package's names: the former homes still work (and warn), one bubble formula,
one parser of device names."""

import importlib
import warnings

import pytest

import tfdist
from tfdist import devices, planning, split


def _quietly(module_name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(module_name)


def test_tfdist_cost_still_has_every_name_and_warns():
    cost = _quietly("tfdist.cost")
    for name in cost.__all__:
        new = "HardwareCluster" if name == "Cluster" else name
        assert getattr(cost, name) is getattr(planning, new), name
    with pytest.warns(DeprecationWarning, match="tfdist.planning"):
        importlib.reload(cost)


def test_former_planner_and_comm_planning_modules_and_plan_names():
    planner = _quietly("tfdist.planner")
    assert planner.plan is tfdist.plan is planning.plan
    assert planner.Plan is planning.Recommendation
    comm_planning = _quietly("tfdist.comm.planning")
    assert comm_planning.recommend is planning.recommend
    with pytest.warns(DeprecationWarning, match="Recommendation"):
        assert tfdist.Plan is planning.Recommendation
    with pytest.warns(DeprecationWarning, match="SplitPlan"):
        assert split.Plan is split.SplitPlan
    assert "Plan" not in tfdist.__all__ and "Recommendation" in tfdist.__all__


@pytest.mark.parametrize("stages, micro_batches", [(1, 1), (2, 8), (4, 12), (8, 3)])
def test_one_bubble_formula(stages, micro_batches):
    expected = (stages - 1) / (micro_batches + stages - 1)
    assert planning.pipeline_bubble(stages=stages, micro_batches=micro_batches) == expected
    assert split.bubble_fraction(stages, micro_batches) == expected
    assert split.ideal_speedup(stages, micro_batches) == planning.pipeline_speedup(
        stages=stages, micro_batches=micro_batches)


@pytest.mark.parametrize("name, parts, canonical, short", [
    ("/cpu:1", (None, None, None, "CPU", 1), "/device:CPU:1", "CPU:1"),
    ("CPU:0", (None, None, None, "CPU", 0), "/device:CPU:0", "CPU:0"),
    ("/device:GPU:3", (None, None, None, "GPU", 3), "/device:GPU:3", "GPU:3"),
    ("/job:worker/replica:0/task:2/device:GPU:1", ("worker", 0, 2, "GPU", 1),
     "/job:worker/replica:0/task:2/device:GPU:1", "GPU:1"),
    ("/job:localhost/device:cpu:0", ("localhost", None, None, "CPU", 0),
     "/job:localhost/device:CPU:0", "CPU:0"),
])
def test_device_names_are_read_in_one_place(name, parts, canonical, short):
    parsed = devices.parse_device_name(name)
    assert (parsed.job, parsed.replica, parsed.task, parsed.kind, parsed.index) == parts
    assert devices.canonical_device(name) == canonical
    assert devices.short_device_name(name) == short
    assert devices.task_index(name) == parts[2]


def test_task_index_reads_worker_names_without_a_device():
    # What the parameter-server coordinator reports for a failed worker.
    assert devices.task_index("/job:worker/replica:0/task:1") == 1
    assert devices.task_index("/job:worker/task:12") == 12
    assert devices.task_index("/job:worker") is None


@pytest.mark.parametrize("bad", ["gpu-one", "/cpu", "", "/job:w/task:x/device:CPU:0", 3])
def test_bad_device_names_are_refused_with_the_expected_form(bad):
    with pytest.raises(ValueError, match=r"must be a TensorFlow device name such as '/cpu:0'"):
        devices.parse_device_name(bad)
    assert devices.task_index(bad) is None
    if isinstance(bad, str):
        assert devices.short_device_name(bad) == bad
