"""Which optimizers and layers ZeRO sharding accepts: the registries and their checks.

Pure Python (Keras imported when a check runs). tfdist.sharding's public
`register_elementwise_optimizer`, `register_gatherable_layer`,
`supported_optimizers` and `gatherable_layers` read and extend them; the
compat fixes of tfdist.compat.sharding_variables ask `check_optimizer` when a
slot is made sharded and `is_gatherable` when a layer owning stage-3 weights
runs.
"""

from __future__ import annotations

from typing import Any

# Element-wise optimizers: their update of each element depends only on that element of
# the variable, its gradient and its slots, so updating a shard is updating the variable.
# Lamb (layer-wise norms), Adafactor (factored moments), Muon (matrix orthogonalisation)
# are not.
_ELEMENTWISE_OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                           "Adadelta", "Ftrl", "Lion"]
_extra_optimizers: list[type] = []

# Layers whose call() is a pure function of its inputs and weights (no state updates, no
# randomness), so a layer owning stage-3 weights can run under keras.remat: the weights it
# gathers are dropped after its forward pass and gathered again for its backward pass (its
# forward runs twice). Keras's, matched by class (subclasses included) ...
_GATHERABLE_LAYERS = ["Dense", "EinsumDense", "Embedding", "Conv1D", "Conv2D", "Conv3D",
                      "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
                      "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D",
                      "SeparableConv2D", "LayerNormalization", "GroupNormalization",
                      "RMSNormalization"]
# ... and KerasHub's weight-owning layers whose call was read and found pure (KerasHub 0.32),
# matched by module-qualified name along the layer's MRO, so KerasHub is never imported.
# KerasHub's other weight-owning layers (with a Dropout or DropPath inside, the mixture-of-
# experts blocks, attention layers owning their projections, ...) and BatchNormalization run
# without remat: they gather on every read of a weight and keep what they gathered until
# their backward pass, which is exact for any layer and costs that layer's whole weights
# between its forward and backward passes.
_KERAS_HUB_GATHERABLE = (
    "keras_hub.src.layers.modeling.masked_lm_head.MaskedLMHead",
    "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding",
    "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization",
    "keras_hub.src.models.dinov2.dinov2_layers.DINOV2LayerScale",
    "keras_hub.src.models.dinov3.dinov3_layers.DINOV3LayerScale",
    "keras_hub.src.models.gemma.rms_normalization.RMSNormalization",
    "keras_hub.src.models.gemma3.gemma3_layers.RMSNormalization",
    "keras_hub.src.models.gpt_oss.gpt_oss_layer_norm.GptOssLayerNormalization",
    "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm",
    "keras_hub.src.models.mistral.mistral_layer_norm.MistralLayerNormalization",
    "keras_hub.src.models.mixtral.mixtral_layer_norm.MixtralLayerNormalization",
    "keras_hub.src.models.phi3.phi3_layernorm.Phi3LayerNorm",
    "keras_hub.src.models.qwen.qwen_layernorm.QwenLayerNorm",
    "keras_hub.src.models.qwen3.qwen3_layernorm.Qwen3LayerNorm",
    "keras_hub.src.models.qwen3_moe.qwen3_moe_layernorm.Qwen3MoeLayerNorm",
    "keras_hub.src.models.qwen_moe.qwen_moe_layernorm.QwenMoeLayerNorm",
    "keras_hub.src.models.roformer_v2.roformer_v2_attention.RoformerNorm",
    "keras_hub.src.models.t5.t5_layer_norm.T5LayerNorm",
    "keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding",
    "keras_hub.src.models.vit_det.vit_layers.AddPositionalEmbedding",
)
_extra_layers: list[type] = []


def qualified(cls: type) -> str:
    """`module.QualifiedName` of a class (how the registries name layers)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def supported_optimizers() -> tuple[str, ...]:
    return tuple(_ELEMENTWISE_OPTIMIZERS) + tuple(c.__name__ for c in _extra_optimizers)


def gatherable_layers() -> tuple[str, ...]:
    """Module-qualified names of the layer classes run under keras.remat at stage 3."""
    return (tuple(f"keras.layers.{n}" for n in _GATHERABLE_LAYERS) + _KERAS_HUB_GATHERABLE
            + tuple(qualified(c) for c in _extra_layers))


def register_elementwise_optimizer(cls: type) -> type:
    """Declares that `cls.update_step` is element-wise (safe to run on shards)."""
    if cls not in _extra_optimizers:
        _extra_optimizers.append(cls)
    return cls


def register_gatherable_layer(cls: type) -> type:
    """Declares that `cls.call` is a pure function of its inputs and weights."""
    if not isinstance(cls, type):
        raise ValueError("register_gatherable_layer takes a layer class. Received: "
                         f"{cls!r} ({type(cls).__name__}). Fix: pass the class, e.g. "
                         "register_gatherable_layer(MyLayer).")
    if cls not in _extra_layers:
        _extra_layers.append(cls)
    return cls


def _keras_classes(names: list[str]) -> tuple[type, ...]:
    import keras

    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


def is_gatherable(layer: Any) -> bool:
    """True if `layer` may run under keras.remat (its call is known to be pure)."""
    if isinstance(layer, _keras_classes(_GATHERABLE_LAYERS) + tuple(_extra_layers)):
        return True
    return any(qualified(cls) in _KERAS_HUB_GATHERABLE for cls in type(layer).__mro__)


def check_optimizer(optimizer: Any, *, stage: int) -> None:
    """Raises ValueError if `optimizer` cannot be sharded (received / expected / fix)."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        optimizer = inner
    known = tuple(getattr(keras.optimizers, n) for n in _ELEMENTWISE_OPTIMIZERS)
    if type(optimizer) not in known + tuple(_extra_optimizers):
        raise ValueError(
            f"Sharding updates each replica's 1/N of every variable with the optimizer's own "
            f"update_step, which is only exact for element-wise optimizers. Received: "
            f"{type(optimizer).__name__}. Supported: {', '.join(supported_optimizers())}. "
            "Fix: use one of these, shard='none', or (if its update is element-wise) "
            "tfdist.sharding.register_elementwise_optimizer(YourOptimizer).")
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            "Sharding does not support use_ema=True (the moving average is kept whole and "
            "updated outside the optimizer's update step). Received: "
            f"{type(optimizer).__name__}(use_ema=True). Fix: use_ema=False, or shard='none'.")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "Sharding does not support gradient_accumulation_steps (the accumulators are "
            "whole variables updated outside the sharded update). Received: "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}. Fix: drop "
            "it (raise the global batch instead), or shard='none'.")
    if stage >= 3:
        clips = {name: getattr(optimizer, name, None)
                 for name in ("clipnorm", "global_clipnorm", "clipvalue")}
        given = {name: value for name, value in clips.items() if value is not None}
        if given:
            raise ValueError(
                "shard='parameters' hands the optimizer gradients that are already summed "
                "over replicas and cut into shards, so Keras's gradient clipping (which acts "
                "on each replica's whole, unreduced gradient) cannot run. Received: "
                f"{', '.join(f'{k}={v}' for k, v in given.items())}. Fix: drop clipping, or "
                "use shard='gradients'.")
