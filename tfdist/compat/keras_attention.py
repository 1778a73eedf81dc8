"""MultiHeadAttention's projection sub-layers: read them and swap one in place.

Keras 3's `MultiHeadAttention` keeps its query, key, value and output
projections as private `EinsumDense` attributes (`_query_dense`, ...;
keras/src/layers/attention/multi_head_attention.py) and has no API to
replace them. tfdist.split's head-parallel attention swaps each for a
sharded version; this module is the only place that touches those names and
Keras's layer tracker. Checked on the versions in `tfdist.compat.TESTED`;
tests/split/test_split_model.py::test_tensor_parallel_attention_heads_equal_unsplit fails
if they change.
"""

from __future__ import annotations

from tfdist._tf import import_tensorflow

import_tensorflow()  # quietly, before keras imports TensorFlow itself

import keras  # noqa: E402

# (private attribute, the way a head-parallel split cuts it)
PROJECTIONS: tuple[tuple[str, str], ...] = (
    ("_query_dense", "column"), ("_key_dense", "column"),
    ("_value_dense", "column"), ("_output_dense", "row"))


def projections(layer) -> list[tuple[str, str, object]]:
    """[(name, mode, EinsumDense)] of a built MultiHeadAttention, in weight order.

    Raises:
      RuntimeError: this Keras version's MultiHeadAttention has another shape.
    """
    out = []
    for attr, mode in PROJECTIONS:
        sub = getattr(layer, attr, None)
        if sub is None or not isinstance(sub, keras.layers.Layer):
            raise RuntimeError(
                f"MultiHeadAttention has no projection {attr} in Keras {keras.__version__}; "
                "tfdist.compat.keras_attention needs updating for this version.")
        out.append((attr, mode, sub))
    return out


def replace_projection(layer, attr: str, new) -> None:
    """Puts `new` where the projection `attr` was, keeping the layer's weight order."""
    for name in ("_layers", "_tracker"):
        if not hasattr(layer, name):
            raise RuntimeError(f"keras Layer has no {name} in Keras {keras.__version__}; "
                               "tfdist.compat.keras_attention needs updating.")
    tracked = layer._layers   # the tracker's list of sub-layers
    tracker = layer._tracker  # locked after build(); unlocked for the swap only
    old = getattr(layer, attr)
    index = next(i for i, sub in enumerate(tracked) if sub is old)
    tracker.unlock()
    try:
        setattr(layer, attr, new)  # Keras appends `new` to the tracked layers...
    finally:
        tracker.lock()
    tracked.remove(new)            # ...so put it where `old` was
    tracked[index] = new
