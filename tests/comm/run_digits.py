"""The digits default run (experiments.train defaults) once per gradient compression.

Run in a fresh process by tests/comm/test_compression.py; prints one JSON line
{method: held-out accuracy}. One process for every method: each
`make_strategy("mirrored")` gets fresh collective keys.
"""

import json
import sys

from absl import flags

from experiments import train  # defines the flags with their defaults

FLAGS = flags.FLAGS


def main() -> None:
    FLAGS(["train"])
    import tfdist
    import tfdist._tf

    tfdist.configure_logical_devices(FLAGS.logical_devices)
    accuracy = {}
    tf = tfdist._tf.import_tensorflow()
    for method in sys.argv[1:]:
        # train.run builds its shuffled dataset before it seeds Keras: as in a run of its
        # own (`python -m experiments.train`), no global seed is set at that point.
        tf.random.set_seed(None)
        options = tfdist.MirroredOptions(gradient_compression=method)
        metrics = train.run(
            strategy_options=options, model_name=FLAGS.model, dataset_name=FLAGS.dataset,
            global_batch_size=FLAGS.global_batch_size, epochs=FLAGS.epochs,
            steps_per_epoch=FLAGS.steps_per_epoch, learning_rate=FLAGS.learning_rate,
            seed=FLAGS.seed, verbose=0)
        accuracy[method] = metrics["test_accuracy"]
        print(json.dumps({"partial": accuracy}), flush=True)
    print(json.dumps(accuracy), flush=True)


if __name__ == "__main__":
    main()
