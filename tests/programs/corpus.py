"""What the corpus programs share: the entry point, how each one is judged, synthetic data.

Each program in tests/programs/ is one public example (a keras.io guide or example, a
KerasHub guide), shrunk and offline, otherwise the program as written. It defines

    SOURCE = "https://github.com/keras-team/keras-io/blob/master/guides/....py"
    COMPARE = Exact()                     # or Property(reason="Dropout")
    def main(run: Run) -> Outcome: ...

and its docstring says what was changed from the source. `run.make_strategy()` is where
the source makes its strategy (or, for a single-device program, where its user swaps one
in): it returns the preset's strategy, and a new one when the same program asks again.

No TensorFlow import here: the runner decides when TensorFlow starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# Table order. Each name is a module tests/programs/<name>.py.
PROGRAMS = (
    "distributed_training",
    "built_in_training",
    "custom_losses_metrics",
    "endpoint_layer",
    "class_sample_weights",
    "py_dataset_input",
    "multi_input_output",
    "built_in_callbacks",
    "custom_callbacks",
    "custom_train_step",
    "knowledge_distillation",
    "trainer_pattern",
    "gan_train_step",
    "vae_train_step",
    "subclassing_vae",
    "functional_api",
    "serialization_and_saving",
    "transfer_learning",
    "preprocessing_layers",
    "text_classification_from_scratch",
    "bidirectional_lstm",
    "mnist_convnet",
    "structured_data_feature_space",
    "timeseries_classification",
    "text_classification_transformer",
    "kerashub_bert_classifier",
    "kerashub_custom_model_xla",
    "kerashub_gemma_lora",
    "kerashub_gpt2_finetune",
    "kerashub_gpt2_lora",
)

# What runs on every push (tests/programs/test_corpus.py): one program per kind of result
# the table shows, the cheapest of each. The whole corpus: TFDIST_FULL_CORPUS=1.
PUSH_SUBSET = (
    "built_in_training",                 # NumPy and shuffled tf.data input; evaluate, predict
    "custom_losses_metrics",             # custom losses, a metric returning its variable, add_loss
    "endpoint_layer",                    # add_loss of a Loss object
    "py_dataset_input",                  # a PyDataset (shuffled, in threads) and a generator
    "custom_callbacks",                  # every callback hook; set_weights, learning rate
    "knowledge_distillation",            # compute_loss overridden; a partial last batch
    "vae_train_step",                    # train_step without call()
    "serialization_and_saving",          # save, reload, weights, export (files on 2 workers)
    "text_classification_from_scratch",  # strings in the model and in tf.data
)

SEED = 1337
KERAS_IO = "https://github.com/keras-team/keras-io/blob/master/"


@dataclasses.dataclass(frozen=True)
class Exact:
    """The program is deterministic: it must equal the one-device run.

    Same seed, initial weights and global batch; every final weight (all models the
    program returns, non-trainable ones included) within `weights`, every logged loss
    within `loss`, absolute.
    """

    weights: float = 1e-5
    loss: float = 1e-5

    def describe(self) -> str:
        return f"equal: \\|Δw\\| ≤ {self.weights:g}, \\|Δloss\\| ≤ {self.loss:g}"


@dataclasses.dataclass(frozen=True)
class Property:
    """The program is not deterministic across presets (`reason`): judged by a property.

    Every logged value and final weight finite; the optimizer steps as many times as on one
    device; with `trend` "falling" (or "rising"), the last value of the program's trend
    sequence (`Outcome.trend`, by default its logged losses) below (above) the first.
    """

    reason: str
    trend: str | None = "falling"

    def __post_init__(self):
        if self.trend not in ("falling", "rising", None):
            raise ValueError(f"trend must be 'falling', 'rising' or None. Received: "
                             f"trend={self.trend!r}")

    def describe(self) -> str:
        trend = f", {self.trend}" if self.trend else ""
        return f"trains (finite{trend} loss, same step count); not deterministic: {self.reason}"


@dataclasses.dataclass
class Outcome:
    """What a program hands back to be compared.

    Attributes:
      models: the trained models whose final weights are compared (in order).
      losses: the logged losses, in the order the program logged them (every epoch of
        every fit, then evaluate results): compared against one device.
      checks: named differences the program measured itself (e.g. a reloaded model's
        predictions against the trained one's); each must be <= CHECK_TOLERANCE.
      trend: the values a Property's trend is judged on (None: `losses`), e.g. the accuracy
        of a program that logs no loss.
    """

    models: list
    losses: list
    checks: dict = dataclasses.field(default_factory=dict)
    trend: list | None = None


CHECK_TOLERANCE = 1e-5


@dataclasses.dataclass
class Run:
    """One program's view of the preset it runs under.

    Attributes:
      preset: the runner's preset name ("one_device", "mirrored", ...).
      workdir: an empty directory for the program's files (the same path on every worker).
      strategy_factory: makes a new strategy of the preset.
      shared_strategy: the process's strategy (made when the process started).
    """

    preset: str
    workdir: str
    strategy_factory: Callable[[], Any]
    shared_strategy: Any
    _calls: int = 0

    def make_strategy(self):
        """The strategy the program's source makes: the preset's, then a new one per call."""
        self._calls += 1
        if self._calls == 1:
            return self.shared_strategy
        return self.strategy_factory()


def logged(history, key: str = "loss") -> list[float]:
    """One fit's logged values of `key`, one per epoch."""
    return [float(v) for v in history.history[key]]


def finite(values) -> bool:
    return all(math.isfinite(float(v)) for v in values)


# ---------------------------------------------------------------------------------------
# Synthetic, learnable data in place of the downloads (MNIST, IMDB, ...). Deterministic.


def digits(n: int, *, features: int = 64, classes: int = 10, seed: int = 0):
    """(x, y): float32 features in [0, 1] around one prototype per class, int64 labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prototypes = np.random.default_rng(1000 + classes).uniform(0.0, 1.0, (classes, features))
    y = rng.integers(0, classes, size=n)
    x = np.clip(prototypes[y] + 0.2 * rng.standard_normal((n, features)), 0.0, 1.0)
    return x.astype("float32"), y.astype("int64")


def images(n: int, *, shape=(8, 8, 1), classes: int = 10, seed: int = 0):
    """(x, y): `digits` reshaped to images of `shape`, values in [0, 1]."""
    import numpy as np

    x, y = digits(n, features=int(np.prod(shape)), classes=classes, seed=seed)
    return x.reshape((n, *shape)), y


POSITIVE = ("great", "wonderful", "superb", "moving", "brilliant", "delightful", "fun", "best")
NEGATIVE = ("awful", "boring", "dull", "terrible", "worst", "bland", "tedious", "poor")
FILLER = ("the", "movie", "film", "plot", "actors", "was", "a", "and", "story", "it", "this",
          "really", "scene", "ending", "music", "very", "of", "with", "characters", "i")


def reviews(n: int, *, words: int = 12, seed: int = 0):
    """(texts, labels): short movie reviews as a numpy array of str; label 1 = positive.

    Each review mixes filler words with three sentiment words of its class (IMDB's shape).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=n)
    texts = []
    for label in labels:
        pool = POSITIVE if label else NEGATIVE
        tokens = list(rng.choice(FILLER, size=words - 3)) + list(rng.choice(pool, size=3))
        rng.shuffle(tokens)
        texts.append(" ".join(tokens))
    return np.array(texts), labels.astype("int64")


def word_vocabulary() -> list[str]:
    """Every word `reviews` writes, sorted."""
    return sorted(set(FILLER + POSITIVE + NEGATIVE))


def gpt2_vocabulary(words) -> tuple[dict, list]:
    """(vocabulary, merges) of a tiny byte-level BPE (GPT-2's format) that knows `words`.

    Single characters (a-z, A-Z, digits, space as "Ġ", some punctuation) are tokens, and each
    word preceded by a space ("Ġgreat") is one token, reached by merging its prefixes left to
    right; every intermediate prefix is a token too, so any merge order yields known tokens.
    """
    import string

    vocabulary = {"<|endoftext|>": 0}
    for ch in "Ġ" + string.ascii_letters + string.digits + ".,!?'-":
        vocabulary.setdefault(ch, len(vocabulary))
    merges = []
    for word in words:
        prefix = "Ġ"
        for ch in word:
            merge = f"{prefix} {ch}"
            if merge not in merges:
                merges.append(merge)
            prefix += ch
            vocabulary.setdefault(prefix, len(vocabulary))
    return vocabulary, merges


def sentencepiece_proto(texts, *, vocab_size: int = 40) -> bytes:
    """A SentencePiece word model trained in memory on `texts` (Gemma's tokenizer format)."""
    import io

    import sentencepiece

    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)), model_writer=buffer, vocab_size=vocab_size,
        model_type="word", pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="<pad>",
        bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    return buffer.getvalue()
