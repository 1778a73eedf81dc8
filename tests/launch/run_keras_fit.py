"""A user's multi-worker script, written as the TensorFlow tutorials write it, for the output tests.

TensorFlow is imported first (so it prints its start-up lines), every worker
calls `model.fit` with Keras's default progress bar, and worker 1 warns.
"""

import json
import os
import time
import warnings

import tensorflow as tf  # noqa: F401  (first, as in the tutorials)

import keras
import numpy as np

import tfdist

strategy = tfdist.make_strategy("multi_worker_mirrored")
task = json.loads(os.environ["TF_CONFIG"])["task"]
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
x = rng.standard_normal((96, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)
if task["index"] == 1:
    warnings.warn("worker 1 warns about something", stacklevel=1)
# Steps as slow as a real model's, so the bar is seen while it moves.
slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.2))
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat(), epochs=2,
          steps_per_epoch=3, callbacks=[slow])
print(f"{task['type']}:{task['index']} done", flush=True)
