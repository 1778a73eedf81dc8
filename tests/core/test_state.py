"""One record per strategy (tfdist.state) and presets that declare what they add (installs)."""

import ast
import os

import pytest

import tfdist
from tests.support import REPO
from tfdist import state as state_lib
from tfdist import strategies


def test_a_made_strategy_has_one_record_with_its_preset_options_and_features():
    strategy = tfdist.make_strategy("mirrored", num_devices=2, sync_batch_norm=True)
    state = tfdist.state_of(strategy)
    assert state.preset == "mirrored"
    assert state.options == tfdist.MirroredOptions(num_devices=2, sync_batch_norm=True)
    assert state.features == tuple(f.name for f in tfdist.installs(
        "mirrored", num_devices=2, sync_batch_norm=True).features)
    assert state.features == ("keras_epoch_iterator", "optimizer_update", "keras_build",
                              "batch_norm", "keras_multi_step", "keras_losses", "keras_xla",
                              "loss_scale", "keras_backup")
    assert state.sync_batch_norm is True
    assert state.gradient_sync is None and state.sharding_plan is None
    assert state_lib.adopt(strategy) is state  # adopting again changes nothing


def test_optional_features_attach_only_when_their_options_ask():
    from tfdist import sharding

    sharded = tfdist.make_strategy("mirrored", num_devices=2, shard="gradients")
    state = tfdist.state_of(sharded)
    assert state.features[-1] == "sharding"
    assert state.sharding_plan is sharding.plan_of(sharded)
    assert state.sharding_plan.shard == "gradients"
    assert type(state.gradient_sync).__name__ == "ShardedSync"
    compressed = tfdist.make_strategy("mirrored", num_devices=2, gradient_compression="fp16")
    state = tfdist.state_of(compressed)
    assert state.features[-1] == "comm" and "sharding" not in state.features
    assert type(state.gradient_sync).__name__ == "CommSync"


def test_strategies_tfdist_did_not_make_have_no_record():
    import tensorflow as tf

    assert tfdist.state_of(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])) is None
    assert tfdist.state_of(tf.distribute.get_strategy()) is None
    assert tfdist.state_of(tfdist.make_strategy("default")) is None
    assert tfdist.state_of(None) is None
    assert tfdist.state_of([]) is None  # unhashable
    with pytest.raises(ValueError, match="never adopts TensorFlow's default strategy"):
        state_lib.adopt(tf.distribute.get_strategy())


@pytest.mark.parametrize("preset, options, features, fixes", [
    ("default", {}, (), ()),
    ("one_device", {}, ("optimizer_update", "keras_build", "batch_norm", "keras_multi_step",
                        "keras_losses", "keras_xla", "loss_scale", "keras_backup"), ()),
    ("mirrored", {"shard": "optimizer"},
     ("keras_epoch_iterator", "optimizer_update", "keras_build", "batch_norm",
      "keras_multi_step", "keras_losses", "keras_xla", "loss_scale", "keras_backup", "sharding"),
     ("collective_keys", "sharding_variables")),
    ("mirrored", {"gradient_compression": "bf16"},
     ("keras_epoch_iterator", "optimizer_update", "keras_build", "batch_norm",
      "keras_multi_step", "keras_losses", "keras_xla", "loss_scale", "keras_backup", "comm"),
     ("collective_keys", "comm_collectives")),
    ("multi_worker_mirrored", {}, ("keras_multi_worker", "initial_values", "keras_log_reduction",
                                   "keras_array_input", "keras_epoch_iterator",
                                   "optimizer_update", "keras_build", "batch_norm",
                                   "keras_multi_step", "keras_losses", "keras_xla", "loss_scale",
                                   "keras_backup"),
     ("keras_multi_worker", "keras_files", "collective_keys", "initial_values",
      "keras_log_reduction", "keras_array_input", "keras_epoch_iterator")),
    ("parameter_server", {"local_workers": 1, "local_ps": 1},
     ("ps_recovery", "optimizer_update", "keras_build", "batch_norm", "keras_multi_step",
      "keras_losses", "keras_xla", "loss_scale", "keras_backup"),
     ("ps_keras", "ps_variables", "ps_tables", "ps_fit", "ps_recovery")),
])
def test_installs_reads_the_registry_row(preset, options, features, fixes):
    installs = tfdist.installs(preset, **options)
    assert installs.preset == preset
    assert tuple(f.name for f in installs.features) == features
    assert set(fixes) <= set(installs.fixes)
    for feature in installs.features:
        assert set(feature.fixes) <= set(installs.fixes)
    with pytest.raises(ValueError, match="Unknown preset 'mirorred'. Valid presets: default"):
        tfdist.installs("mirorred")


def test_a_users_preset_declares_its_features():
    calls = []

    def factory(options):
        import tensorflow as tf

        return tf.distribute.OneDeviceStrategy("/cpu:1")

    feature = strategies.Feature("note", "records that it ran", when="always", fixes=(),
                                 attach=lambda s, o, st: calls.append((s, st.preset)))

    class NoteOptions(tfdist.OneDeviceOptions):
        preset = "note_test_preset"

    try:
        tfdist.register_preset("note_test_preset", options=NoteOptions, summary="test",
                               needs="nothing", features=(feature,), factory=factory)
        strategy = tfdist.make_strategy("note_test_preset")
        assert calls == [(strategy, "note_test_preset")]
        assert tfdist.state_of(strategy).features == ("note",)
    finally:
        strategies._REGISTRY.pop("note_test_preset", None)


# Weak tables tfdist keeps, and what they are keyed by. Everything tfdist attaches to a
# strategy is a field of its StrategyState: a new table keyed by strategies fails here.
ALLOWED_WEAK_TABLES = {
    "tfdist/state.py": "the one map: strategy -> StrategyState",
    "tfdist/comm/sync.py": "optimizer -> PowerSGD state, inside one CommSync",
    "tfdist/compat/optimizer_update.py": "optimizers opted in to summed sparse gradients",
    "tfdist/compat/placed_training.py": "optimizers whose slots follow their variables",
    "tfdist/ps/keras_api.py": "model -> exact-evaluation shards",
    "tfdist/compat/ps_keras.py": "model -> the evaluate/predict functions built for the "
                                 "parameter-server coordinator",
    "tfdist/ps/trainer.py": "model -> its coordinator trainer",
    "tfdist/compat/ps_recovery.py": "TensorFlow's failure handler (one per coordinator) -> "
                                    "the PartialRecovery its fixes route to",
    "tfdist/sharding/sync.py": "optimizers one ShardedSync has checked",
    "tfdist/sync.py": "optimizers that keep their sparse gradients slice by slice",
    "tfdist/compat/keras_xla.py": "models already warned that XLA is off",
}


def test_no_module_keeps_its_own_table_of_strategies():
    found = {}
    for folder, _, names in os.walk(os.path.join(REPO, "tfdist")):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in (
                        "WeakKeyDictionary", "WeakSet", "WeakValueDictionary"):
                    found.setdefault(os.path.relpath(path, REPO), node.attr)
    assert set(found) <= set(ALLOWED_WEAK_TABLES), sorted(set(found) - set(ALLOWED_WEAK_TABLES))
    assert "tfdist/state.py" in found
