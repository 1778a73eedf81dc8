"""Variables of any dtype under multi_worker_mirrored: the initial-value broadcast widens.

When a MultiWorkerMirroredStrategy spanning several workers creates a
variable, worker 0 broadcasts its initial value to the others
(`CollectiveAllReduceExtended._get_variable_creator_initial_value`, through
`collective_ops.broadcast_send/recv`). TensorFlow's CollectiveBcastSend and
CollectiveBcastRecv accept only bool, float16/32/64 and int32/64, so a
variable of any other dtype fails at creation: a KerasHub model under a
`bfloat16` dtype policy (keras.io's Gemma LoRA guide) dies with "Value for
attr 'T' of bfloat16 is not in the list of allowed values", and so would an
int8 or uint8 variable (quantized layers). No upstream issue found
(TensorFlow 2.21's op definitions still list those six types).

Fix `initial_values.broadcast`, for strategies tfdist made, widens such an
initial value before the broadcast to a dtype the ops take and that holds it
exactly (bfloat16 -> float32; int8, uint8, int16, uint16 -> int32; uint32 ->
int64) and casts the received value back, so every worker starts from worker
0's value bit for bit, as with any other dtype. Every other variable, and
every strategy tfdist did not make, goes through TensorFlow's code
unchanged.
"""

from __future__ import annotations

from typing import Any

from tfdist.compat import _owner, _patch

NAME = "initial_values.broadcast"
ISSUE = ("none found: CollectiveBcastSend/Recv take bool, float16/32/64, int32/64 only, so "
         "MultiWorkerMirroredStrategy cannot create a bfloat16, int8, ... variable")

# dtype name -> the dtype its initial value is broadcast as (exactly representable).
WIDER = {"bfloat16": "float32", "int8": "int32", "uint8": "int32", "int16": "int32",
         "uint16": "int32", "uint32": "int64"}


def _extended_class():
    return _patch.upstream(
        "tensorflow.python.distribute.collective_all_reduce_strategy.CollectiveAllReduceExtended")


def _check(original) -> None:
    _patch.require_signature(original, "replica_id", "device", "primary_var", "kwargs",
                             what="CollectiveAllReduceExtended._get_variable_creator_initial_value")
    _patch.require_attributes(_extended_class(), "_container_strategy",
                              what="CollectiveAllReduceExtended")


def _applies(extended, replica_id, *args, **kwargs) -> bool:
    return (replica_id == 0 and getattr(extended, "_num_workers", 1) > 1
            and _owner.owns(extended._container_strategy()))


def _make(original):
    @_patch.passthrough(original, _applies)
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        from tfdist._tf import import_tensorflow

        tf = import_tensorflow()
        checkpoint_value = _patch.upstream(
            "tensorflow.python.trackable.base.CheckpointInitialValue")
        initial_value, dtype = kwargs["initial_value"], kwargs.get("dtype")
        created: dict[str, Any] = {}

        def widened():
            value = initial_value() if callable(initial_value) else initial_value
            if isinstance(value, checkpoint_value):
                value = value.wrapped_value
            value = tf.convert_to_tensor(value, dtype=dtype)
            created["dtype"] = value.dtype
            wide = WIDER.get(value.dtype.name)
            return value if wide is None else tf.cast(value, wide)

        broadcast = original(self, replica_id, device, primary_var,
                             **dict(kwargs, initial_value=widened, dtype=None))

        def initial_value_fn():
            value = broadcast()
            return value if value.dtype == created["dtype"] else tf.cast(value,
                                                                         created["dtype"])

        return initial_value_fn

    return _get_variable_creator_initial_value


FIX = _patch.Fix(name=NAME, issue=ISSUE,
                 target=lambda: (_extended_class(), "_get_variable_creator_initial_value"),
                 check=_check, make=_make)


def install() -> tuple[str, ...]:
    """Installs the fix (idempotent); returns the names installed by this call."""
    return _patch.install_all((FIX,))
