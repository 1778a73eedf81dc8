"""What several tests build on: running Python in a fresh process, a no-orphan check, a
tied-embedding layer, a FLOP count from TF's profiler, a small model with the shapes real ones
have, the tutorial's custom loop, and comparisons against one device."""

from __future__ import annotations

import os
import subprocess
import sys

import keras

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(*args: str, timeout: float = 120, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """Runs `python ARGS` from the repository root with a bounded timeout."""
    full_env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    full_env.pop("TFDIST_QUIET_SET_LOG_LEVEL", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def run_in_own_session(*args: str, timeout: float) -> tuple[int, str, bool]:
    """`python ARGS` from the repository root in a session of its own.

    Returns (exit code, stdout and stderr together, whether any process of the session
    outlived it). On a timeout every process of the session is killed with it.
    """
    import signal

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            left = True
        except ProcessLookupError:
            left = False
        proc.wait()
    return proc.returncode, log, left


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone): for no-orphan checks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def namespaces_refused() -> str | None:
    """None when experiments.netlab can build simulated nodes here, else why not (a skip reason)."""
    from experiments.netlab import NetLab

    problem = NetLab.available()
    if problem:
        return problem
    try:
        NetLab(1).close()
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        return f"cannot make a network namespace here: {e}"
    return None


def running_roles(module: str, role: str = "") -> list[int]:
    """Pids of live processes running `module` (e.g. "experiments.bench_cluster") with a
    `--role=<role>...` argument: a benchmark's workers, for no-leftover checks."""
    import glob

    module_arg, role_arg = module.encode(), f"--role={role}".encode()
    pids = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # ended while we looked
            continue
        if module_arg in argv and any(a.startswith(role_arg) for a in argv) \
                and alive(int(path.split("/")[2])):
            pids.append(int(path.split("/")[2]))
    return pids


def live_namespaces() -> set[str]:
    """The network namespaces some process on this machine is in (for no-leftover checks)."""
    import glob

    live = set()
    for path in glob.glob("/proc/[0-9]*/ns/net"):
        try:
            live.add(os.readlink(path))
        except OSError:  # the process ended meanwhile
            pass
    return live


class TiedEmbedding(keras.layers.Embedding):
    """An embedding whose transpose is the output head (KerasHub's ReversibleEmbedding idea)."""

    def call(self, inputs, reverse=False):
        if reverse:
            return keras.ops.matmul(inputs, keras.ops.transpose(self.embeddings))
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.input_dim,), inputs.dtype)
        return super().compute_output_spec(inputs)


class Gated(keras.layers.Layer):
    """A custom layer holding a nested Dense, its input scaled by a weight of its own."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(units)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.gate = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gate")

    def call(self, x):
        return self.inner(x * self.gate)


def embedding_gated_model(vocab: int, length: int, features: int = 6, outputs: int = 3,
                          seed: int = 7) -> keras.Model:
    """(ids, features) -> Embedding (sparse gradients) -> Dense -> LayerNorm -> Gated -> Dense.

    Uncompiled; the same initial weights for the same `seed`.
    """
    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    extra = keras.Input((features,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(vocab, 4)(ids))
    x = keras.layers.Concatenate()([embedded, extra])
    x = keras.layers.LayerNormalization()(keras.layers.Dense(16, activation="tanh")(x))
    return keras.Model([ids, extra], keras.layers.Dense(outputs)(Gated(8)(x)))


def conv_model(input_shape=(8, 8, 4), filters: int = 8, layers: int = 3, outputs: int = 4,
               seed: int | None = None) -> keras.Model:
    """`layers` x Conv2D(filters, 3, same, relu), global average pooling, Dense(outputs).

    Several buckets' worth of small layers (bench_cluster's conv model, shrunk); uncompiled;
    with `seed`, the same initial weights each time. The head computes in float32, as the
    mixed-precision guide asks.
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    x = inputs
    for _ in range(layers):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(outputs, dtype="float32")(x))


def count_priority_edits(monkeypatch) -> list:
    """The control inputs each call of `tfdist.compat.backward_priority.prioritise` adds
    (one call per replica's traced step with several buckets), from now on."""
    from tfdist.compat import backward_priority

    added: list = []
    original = backward_priority.prioritise

    def counting(buckets):
        added.append(original(buckets))
        return added[-1]

    monkeypatch.setattr(backward_priority, "prioritise", counting)
    return added


def one_device():
    """The single-device reference strategy (the first CPU)."""
    import tensorflow as tf

    return tf.distribute.OneDeviceStrategy("/cpu:0")


def max_abs_difference(a, b) -> float:
    """Largest |a - b| over two equally long lists of arrays, in float64."""
    import numpy as np

    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
               for x, y in zip(a, b))


def model_state(model) -> list:
    """The model's weights and every optimizer variable (slots, accumulators, iterations)."""
    import numpy as np

    return ([np.asarray(w) for w in model.get_weights()]
            + [np.asarray(v) for v in model.optimizer.variables])


def tutorial_custom_loop(strategy, model, optimizer, inputs, targets, global_batch: int) -> None:
    """One epoch of the custom-training tutorial's loop (tensorflow/docs: custom_training).

    A distributed dataset, `strategy.run` in a tf.function, a per-example MSE scaled by the
    global batch (`tf.nn.compute_average_loss`), `optimizer.apply_gradients` in each replica.
    """
    import tensorflow as tf

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(global_batch))

    @tf.function
    def step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), -1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=batch)

    for batch in dataset:
        step(batch)


def profiler_flops(model, spec) -> float:
    """TensorFlow's profiler on the model's own traced forward pass, plus its Einsums.

    The profiler has no FLOP count for Einsum (attention), so those come from
    tfdist.flops. `spec`: the input TensorSpec(s), batch 1.
    """
    import tensorflow as tf

    from tfdist.planning import flops

    fn = tf.function(lambda inputs: model(inputs, training=False))
    graph = fn.get_concrete_function(spec).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    total = tf.compat.v1.profiler.profile(graph=graph, options=options).total_float_ops
    for op in graph.get_operations():
        if op.type == "Einsum":
            total += flops.einsum_flops(op.get_attr("equation").decode(),
                                        [t.shape.as_list() for t in op.inputs])
    return float(total)


def assert_fit_matches(model, reference, x, y, *, tol: float, batch_size: int = 8,
                       epochs: int = 2) -> None:
    """Fits both on the same batches in the same order: every epoch's loss and every weight agree.

    The independent computation the split, pipelined and sequence-parallel
    tests compare against (`reference`: the same model, unsplit, same seed).
    """
    import numpy as np

    fit = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    h_model = model.fit(x, y, **fit).history["loss"]
    h_reference = reference.fit(x, y, **fit).history["loss"]
    assert np.allclose(h_model, h_reference, atol=tol), (h_model, h_reference)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(),
                                                          reference.get_weights()))
    assert diff <= tol, f"weights differ by {diff} > {tol}"
