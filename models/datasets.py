"""Demo datasets that need no download (and MNIST where the network allows).

`digits` is the real 8x8 handwritten-digit set shipped inside scikit-learn
(1,797 images); `synthetic` is a seeded, learnable Gaussian-cluster problem
of any size; `mnist` goes through keras.datasets (cached after the first
download) and fails with a clear message offline.
"""

from __future__ import annotations

import dataclasses

import numpy as np

DATASETS = ("digits", "synthetic", "mnist")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Arrays of one train/test split, float32 images and int32 labels."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_dataset(name: str, *, seed: int = 0, test_fraction: float = 0.2,
                 synthetic_size: int = 4096) -> Dataset:
    """Loads a demo dataset by name.

    Raises:
      ValueError: unknown name (listing the valid ones).
      RuntimeError: `mnist` is not cached and cannot be downloaded.
    """
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = (bunch.images / 16.0).astype("float32")[..., None]  # (N, 8, 8, 1) in [0, 1]
        return _split(name, x, bunch.target.astype("int32"), 10, seed, test_fraction)
    if name == "synthetic":
        rng = np.random.default_rng(seed)
        num_classes = 10
        centers = rng.normal(size=(num_classes, 8, 8, 1)).astype("float32")
        y = rng.integers(0, num_classes, size=synthetic_size).astype("int32")
        x = centers[y] + 0.8 * rng.normal(size=(synthetic_size, 8, 8, 1)).astype("float32")
        return _split(name, x, y, num_classes, seed, test_fraction)
    if name == "mnist":
        import keras

        try:
            (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
        except Exception as e:  # URLError, HTTPError, OSError: no network
            raise RuntimeError(
                f"Could not download MNIST ({type(e).__name__}: {e}). This machine seems to "
                "be offline. Use --dataset=digits (ships with scikit-learn) or "
                "--dataset=synthetic, or copy mnist.npz into ~/.keras/datasets/."
            ) from None
        to_float = lambda a: (a.astype("float32") / 255.0)[..., None]  # noqa: E731
        return Dataset(name, to_float(x_train), y_train.astype("int32"),
                       to_float(x_test), y_test.astype("int32"), 10)
    raise ValueError(f"Unknown dataset {name!r}. Valid datasets: {', '.join(DATASETS)}.")


def _split(name, x, y, num_classes, seed, test_fraction) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)
