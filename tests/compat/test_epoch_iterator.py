"""keras_epoch_iterator: one distributed data iterator per epoch, the weights of one device.

Keras's fit without steps_per_epoch builds a second iterator after each
epoch's last step that the next epoch discards; under a MirroredStrategy each
is a MultiDeviceIterator (hundreds of ms). Counted here by the builds of
`DistributedDataset.__iter__`, with the fix, without it (negative control,
the same tfdist strategy), and under a stock MirroredStrategy (untouched).
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from tfdist.compat import _patch, keras_epoch_iterator

EPOCHS = 3


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((64, 8)).astype("float32"),
            rng.integers(0, 4, size=64).astype("int32"))


def _fit(strategy, shuffled_dataset=False):
    """(weights after EPOCHS shuffled epochs, DistributedDataset builds)."""
    import contextlib

    import keras
    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    builds = []
    original = input_lib.DistributedDataset.__iter__

    def counted(self):
        builds.append(1)
        return original(self)

    x, y = _data()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(input_lib.DistributedDataset, "__iter__", counted)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(4)])
            model.compile(keras.optimizers.Adam(1e-2),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        if shuffled_dataset:  # a tf.data shuffle(): its next order is drawn per iterator
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(16),
                      epochs=EPOCHS, verbose=0)
        else:
            model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=True, verbose=0)
    return np.concatenate([w.numpy().ravel() for w in model.weights]), len(builds)


def test_one_iterator_per_epoch_with_the_weights_of_one_device():
    import tensorflow as tf

    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    assert set(keras_epoch_iterator.NAMES) <= set(_patch.installed())
    fixed, fixed_builds = _fit(strategy)
    one_device, _ = _fit(None)
    stock, stock_builds = _fit(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    # Negative control: the same tfdist strategy with the fix taken out.
    _patch.uninstall(keras_epoch_iterator.NAMES)
    try:
        unfixed, unfixed_builds = _fit(strategy)
    finally:
        keras_epoch_iterator.install()
    # Keras builds one iterator per epoch start and one after each epoch's last step.
    assert unfixed_builds - fixed_builds == EPOCHS, (fixed_builds, unfixed_builds)
    # A strategy tfdist did not make: Keras's own loop, and one iterator more for the symbolic
    # build's first batch (keras_build's fix reads nothing there).
    assert stock_builds == unfixed_builds + 1, (stock_builds, unfixed_builds)
    # Same data order, same weights: the discarded iterator never fed a step.
    assert np.abs(fixed - one_device).max() < 1e-6
    assert np.abs(fixed - unfixed).max() < 1e-6
    assert np.abs(stock - one_device).max() < 1e-6


def test_a_shuffled_dataset_passes_through():
    # Skipping the iterator would make each later epoch take another shuffle() order
    # (0.064 apart after 3 epochs): over a tf.data dataset the fix leaves Keras's loop.
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    fixed, fixed_builds = _fit(strategy, shuffled_dataset=True)
    _patch.uninstall(keras_epoch_iterator.NAMES)
    try:
        unfixed, unfixed_builds = _fit(strategy, shuffled_dataset=True)
    finally:
        keras_epoch_iterator.install()
    assert fixed_builds == unfixed_builds
    assert np.abs(fixed - unfixed).max() == 0.0


def test_multi_worker_preset_builds_one_iterator_per_epoch(monkeypatch):
    # The multi_worker_mirrored preset installs the fix too: its fit reads an auto-sharded
    # DistributedDataset (one worker here, no TF_CONFIG; tests/multi_worker/test_end_to_end.py
    # trains numpy input on 2 workers with it: their weights equal one replica's).
    import tensorflow as tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = tfdist.make_strategy("multi_worker_mirrored")
    assert "keras_epoch_iterator" in tfdist.state_of(strategy).features
    fixed, fixed_builds = _fit(strategy)
    one_device, _ = _fit(None)
    stock, stock_builds = _fit(tf.distribute.MultiWorkerMirroredStrategy())
    _patch.uninstall(keras_epoch_iterator.NAMES)  # negative control
    try:
        unfixed, unfixed_builds = _fit(strategy)
    finally:
        keras_epoch_iterator.install()
    assert unfixed_builds - fixed_builds == EPOCHS, (fixed_builds, unfixed_builds)
    assert stock_builds == unfixed_builds + 1, (stock_builds, unfixed_builds)  # as above
    assert np.abs(fixed - one_device).max() < 1e-6
    assert np.abs(fixed - unfixed).max() < 1e-6
    assert np.abs(stock - one_device).max() < 1e-6


def _release_threads(strategy, known_length: bool = True) -> list[str]:
    """The threads each DistributedIterator of a fit over a finite tf.data dataset died on.

    A daemon thread's name is given a "(daemon)" suffix: a daemon still inside the C++
    destructor when the interpreter exits aborts the process (seen in CI), so the release
    thread must not be one.

    Keras drops the previous epoch's iterator as the next epoch starts; its tf.data
    destructor can wait seconds for the autotuning thread (docs/performance.md), so the
    fix lets go of it on a thread of its own.
    """
    import gc
    import threading
    import time
    import weakref

    import keras
    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    died: list[str] = []
    original = input_lib.DistributedDataset.__iter__

    def tracked(self):
        iterator = original(self)
        def record():
            thread = threading.current_thread()
            died.append(thread.name + (" (daemon)" if thread.daemon else ""))

        weakref.finalize(iterator, record)
        return iterator

    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if not known_length:  # Keras then makes no spare iterator at an epoch's end
        data = data.filter(lambda *_: True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(input_lib.DistributedDataset, "__iter__", tracked)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data.batch(16), epochs=EPOCHS, verbose=0)
    gc.collect()
    deadline = time.monotonic() + 30
    while any(t.name == "tfdist-release-data-iterator" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the release threads did not finish"
        time.sleep(0.05)
    return died


def test_each_epochs_iterator_is_let_go_of_off_the_main_thread():
    strategy = tfdist.make_strategy("mirrored", num_devices=2)
    fixed = _release_threads(strategy)
    # Every epoch's iterator died on the release thread, not in fit's loop (so did the one
    # Keras reads a first batch from to build the model). On the main thread: the spare
    # iterators Keras makes at each epoch's end and never reads.
    assert fixed.count("tfdist-release-data-iterator") >= EPOCHS, fixed
    # A dataset of unknown length: no spare iterators, so every iterator, the last epoch's
    # too (let go of when fit returns), dies on the release thread.
    unknown_length = _release_threads(strategy, known_length=False)
    assert len(unknown_length) >= EPOCHS and "MainThread" not in unknown_length, unknown_length
    # Untouched: a strategy tfdist did not make, with the fix installed (one device: stock
    # MirroredStrategies made one after another in a process collide on collective keys).
    import tensorflow as tf

    stock = tf.distribute.OneDeviceStrategy("/cpu:0")
    stock_threads = _release_threads(stock) + _release_threads(stock, known_length=False)
    assert "tfdist-release-data-iterator" not in stock_threads, stock_threads
    _patch.uninstall(keras_epoch_iterator.NAMES)  # negative control: Keras's own loop
    try:
        unfixed = _release_threads(strategy) + _release_threads(strategy, known_length=False)
    finally:
        keras_epoch_iterator.install()
    assert "tfdist-release-data-iterator" not in unfixed, unfixed
    assert unfixed.count("MainThread") >= 2 * EPOCHS, unfixed
