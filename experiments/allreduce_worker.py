"""One worker of a 2-process all-reduce timing: `python -m experiments.allreduce_worker`.

Started by `experiments.benchmark` with its own TF_CONFIG (127.0.0.1 only).
Every worker all-reduces float32 tensors of each size with a collective ring
(MultiWorkerMirroredStrategy, custom step: no Keras involved) and task 0
prints one JSON line: {"points": [[bytes, median seconds], ...]}.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

_SIZES = flags.DEFINE_list("sizes", ["1024", "1048576"], "Message sizes in bytes.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed all-reduces per size (median kept).")


def _make_step(tf, strategy, elements):
    def replica_fn():
        value = tf.ones([elements], tf.float32)
        return tf.distribute.get_replica_context().all_reduce("SUM", value)[0]

    @tf.function
    def step():
        # A scalar that depends on the whole collective: fetching it waits for it.
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    return step


def main(argv):
    del argv
    from tfdist._tf import import_tensorflow

    tf = import_tensorflow()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=60.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    task = strategy.cluster_resolver.task_id
    steps = {}
    for size in (int(s) for s in _SIZES.value):
        steps[size] = _make_step(tf, strategy, max(1, size // 4))
        for _ in range(2):  # trace, then warm the collective's buffers
            steps[size]().numpy()
    # Interleave the sizes (every repeat times each size once) so a change in
    # machine load hits all sizes alike instead of skewing one of them.
    # Before each timed call, an untimed 4-byte all-reduce lines both workers up,
    # so no call is charged for the peer still finishing the previous one.
    barrier = _make_step(tf, strategy, 1)
    barrier().numpy()
    seconds = {size: [] for size in steps}
    for _ in range(_REPEATS.value):
        for size, step in steps.items():
            barrier().numpy()
            start = time.perf_counter()
            step().numpy()
            seconds[size].append(time.perf_counter() - start)
    points = [[size, statistics.median(values)] for size, values in seconds.items()]
    if task == 0:
        print(json.dumps({"points": points}), flush=True)


if __name__ == "__main__":
    app.run(main)
