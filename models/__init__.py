"""Example Keras models for tfdist's demos, tests and benchmarks.

Plain Keras: no strategy or placement code here. tfdist applies
distribution from outside (`strategy.scope()`, `tfdist.split_model`).
Every builder takes the input shape and class count and returns an
uncompiled `keras.Model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import keras

# keras is imported inside the builders: importing this package must not
# start TensorFlow (tfdist imports it quietly, after flags are parsed).


def build_mlp(input_shape, num_classes: int, *, hidden: tuple[int, ...] = (256, 128),
              dropout: float = 0.0) -> "keras.Model":
    """A multi-layer perceptron on flattened inputs."""
    import keras

    inputs = keras.Input(input_shape, name="inputs")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


def build_cnn(input_shape, num_classes: int, *, filters: tuple[int, ...] = (32, 64)
              ) -> "keras.Model":
    """A small convolutional network for image-like inputs (H, W, C)."""
    import keras

    inputs = keras.Input(input_shape, name="inputs")
    x = inputs
    if len(input_shape) == 2:
        x = keras.layers.Reshape((*input_shape, 1), name="add_channel")(x)
    for i, f in enumerate(filters):
        x = keras.layers.Conv2D(f, 3, padding="same", activation="relu", name=f"conv_{i}")(x)
        if min(x.shape[1], x.shape[2]) >= 4:
            x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(128, activation="relu", name="dense")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")


def build_transformer(input_shape, num_classes: int, *, embed_dim: int = 64,
                      num_heads: int = 4, ff_dim: int = 128, num_blocks: int = 2
                      ) -> "keras.Model":
    """A small Transformer encoder: each image row is a token (H tokens of W*C)."""
    import keras

    inputs = keras.Input(input_shape, name="inputs")
    seq_len = input_shape[0]
    x = keras.layers.Reshape((seq_len, -1), name="rows_as_tokens")(inputs)
    x = keras.layers.Dense(embed_dim, name="embed")(x)
    positions = keras.ops.arange(seq_len)
    x = x + keras.layers.Embedding(seq_len, embed_dim, name="position")(positions)
    for i in range(num_blocks):
        h = keras.layers.LayerNormalization(name=f"block{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads,
                                            name=f"block{i}_attention")(h, h)
        x = keras.layers.Add(name=f"block{i}_add1")([x, h])
        h = keras.layers.LayerNormalization(name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(ff_dim, activation="gelu", name=f"block{i}_ff1")(h)
        h = keras.layers.Dense(embed_dim, name=f"block{i}_ff2")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, h])
    x = keras.layers.LayerNormalization(name="final_ln")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="transformer")


MODELS: dict[str, Callable[..., "keras.Model"]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "transformer": build_transformer,
}


def build_model(name: str, input_shape, num_classes: int, **kwargs) -> "keras.Model":
    """Builds a registered example model by name.

    Raises:
      ValueError: unknown name, listing the valid ones.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}. Valid models: {', '.join(MODELS)}.")
    return MODELS[name](tuple(input_shape), num_classes, **kwargs)
