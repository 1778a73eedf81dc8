"""The KerasHub zoo: every backbone family that builds, tiny, with a small head and its inputs.

    from tests import zoo

    if not zoo.AVAILABLE:
        pytest.skip(zoo.SKIP_REASON)
    for family in zoo.FAMILIES.values():
        model = family.build()                     # random weights, no download
        x, y = family.batch(8, seed=0)             # numpy inputs and regression targets
        model.compile(keras.optimizers.SGD(0.01), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False)

Each family is built from its KerasHub backbone constructor with a tiny
configuration (one or two layers, widths of 8-32, a 64-token vocabulary,
32x32 images), wrapped in a Functional model whose head averages every
backbone output over its non-batch, non-feature axes and maps the result to
`HEAD_UNITS` numbers with a Dense layer (loss: mean squared error against
random targets). The backbone is nested as one layer, as in KerasHub's task
models. Nothing is downloaded: the weights are random.

`Family.tags` says what a family contains, so tests can pick or explain:
  "batchnorm"  BatchNormalization (replica statistics)
  "embedding"  a gather-based embedding (IndexedSlices gradients, section 2)
  "moe"        mixture of experts with a load-balancing loss on the replica's batch
  "dropout"    randomness in training that a config cannot switch off (MiT)

Tokens are drawn from a small vocabulary so ids repeat within a batch (the
sparse-gradient case). Not listed: backbones that wrap other backbones
(CLIP, SigLIP, PaliGemma, SAM, DeepLabV3, RetinaNet, SegFormer, BASNet, D-FINE,
Stable Diffusion 3, ...) and the newest multimodal ones (Gemma 3n/4,
Qwen 3.5); every listed family builds and trains on KerasHub 0.32.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import keras

# keras-hub is an optional test dependency (setup.cfg [test]); imported when a family is built.
AVAILABLE = importlib.util.find_spec("keras_hub") is not None
SKIP_REASON = "" if AVAILABLE else (
    "keras-hub is not installed; pip install -e '.[test]' installs it next to the tested "
    "TensorFlow")

HEAD_UNITS = 4
VOCAB = 64
SEQ = 8
IMAGE = (32, 32, 3)


@dataclasses.dataclass(frozen=True)
class Family:
    """One KerasHub backbone family, tiny.

    Attributes:
      name: the KerasHub backbone class without "Backbone" (e.g. "GPT2").
      kind: "text", "seq2seq", "audio" or "image".
      config: the tiny constructor arguments (vary one with `with_config`).
      tags: see the module docstring.
      note: what a reader of a count needs to know about this family.
    """

    name: str
    kind: str
    config: dict
    tags: frozenset = frozenset()
    note: str = ""

    def backbone(self):
        """The tiny KerasHub backbone (random weights, no download)."""
        import keras_hub

        return getattr(keras_hub.models, f"{self.name}Backbone")(**self.config)

    def with_config(self, **changes) -> "Family":
        """This family with some constructor arguments changed (e.g. an MoE loss at 0)."""
        return dataclasses.replace(self, config={**self.config, **changes})

    def build(self, *, seed: int = 0):
        """The backbone nested in a Functional model with a small Dense head.

        The same `seed` gives the same weights (keras.utils.set_random_seed).
        """
        keras.utils.set_random_seed(seed)
        backbone = self.backbone()
        inputs = _symbolic_inputs(backbone)
        outputs = backbone(inputs)
        parts = list(outputs.values()) if isinstance(outputs, dict) else [outputs]
        pooled = [PoolToFeatures()(p) for p in parts if len(p.shape) >= 2]
        features = pooled[0] if len(pooled) == 1 else keras.layers.Concatenate()(pooled)
        head = keras.layers.Dense(HEAD_UNITS, name="head")(features)
        return keras.Model(inputs, head, name=f"zoo_{self.name.lower()}")

    def batch(self, batch_size: int, *, seed: int = 0):
        """(x, y): numpy inputs for the model `build` returns and (batch, HEAD_UNITS) targets."""
        import numpy as np

        rng = np.random.default_rng(seed)
        backbone_inputs = _input_specs(self)
        x = {}
        for name, (shape, dtype) in backbone_inputs.items():
            full = (batch_size, *[_fill(name, i, d) for i, d in enumerate(shape[1:])])
            if "int" in dtype or "bool" in dtype:
                if "mask" in name:
                    x[name] = np.ones(full, dtype=dtype)
                elif "segment" in name:
                    x[name] = np.zeros(full, dtype=dtype)
                else:
                    x[name] = rng.integers(0, VOCAB, size=full).astype(dtype)
            else:
                x[name] = rng.standard_normal(full).astype(dtype)
        y = rng.standard_normal((batch_size, HEAD_UNITS)).astype("float32")
        if len(x) == 1 and not _dict_inputs(self):
            x = next(iter(x.values()))
        return x, y


def _fill(name: str, index: int, dim):
    if dim is not None:
        return dim
    if name == "encoder_features":  # Whisper: frames, then mel bins (given)
        return 2 * SEQ
    return SEQ


_SPECS: dict[str, dict] = {}


def _input_specs(family: Family) -> dict:
    """{input name: (shape, dtype)} of the family's backbone (built once per process)."""
    if family.name not in _SPECS:
        backbone = family.backbone()
        inputs = backbone.input
        named = inputs if isinstance(inputs, dict) else {"inputs": inputs}
        _SPECS[family.name] = {
            "__dict__": isinstance(inputs, dict),
            **{k: (tuple(v.shape), str(v.dtype)) for k, v in named.items()}}
    specs = dict(_SPECS[family.name])
    specs.pop("__dict__")
    return specs


def _dict_inputs(family: Family) -> bool:
    _input_specs(family)
    return _SPECS[family.name]["__dict__"]


def _symbolic_inputs(backbone):
    inputs = backbone.input
    if isinstance(inputs, dict):
        return {k: keras.Input(shape=v.shape[1:], dtype=v.dtype, name=k)
                for k, v in inputs.items()}
    return keras.Input(shape=inputs.shape[1:], dtype=inputs.dtype, name="inputs")


class PoolToFeatures(keras.layers.Layer):
    """Averages over every axis but the batch and the last: (B, ..., C) -> (B, C)."""

    def call(self, x):
        x = keras.ops.cast(x, "float32")
        if len(x.shape) <= 2:
            return x
        return keras.ops.mean(x, axis=tuple(range(1, len(x.shape) - 1)))

    def compute_output_shape(self, shape):
        return (shape[0], shape[-1])


# --- the families -----------------------------------------------------------------

def _hub(name: str, **kwargs) -> dict:
    del name  # the family's name is the backbone's
    return kwargs


_TEXT = dict(vocabulary_size=VOCAB, num_layers=1, hidden_dim=16, intermediate_dim=32)
_GQA = dict(_TEXT, num_query_heads=2, num_key_value_heads=1)
_EMB = frozenset({"embedding"})

_FAMILY_LIST = [
    # decoder LLMs
    Family("GPT2", "text", _hub("GPT2", **_TEXT, num_heads=2, max_sequence_length=SEQ,
                                dropout=0.0), _EMB),
    Family("GPTNeoX", "text", _hub("GPTNeoX", **_TEXT, num_heads=2, max_sequence_length=SEQ),
           _EMB),
    Family("OPT", "text", _hub("OPT", **_TEXT, num_heads=2, max_sequence_length=SEQ,
                               dropout=0.0), _EMB),
    Family("Bloom", "text", _hub("Bloom", **_TEXT, num_heads=2), _EMB),
    Family("Falcon", "text", _hub("Falcon", **_TEXT, num_attention_heads=2), _EMB),
    Family("Llama", "text", _hub("Llama", **_GQA), _EMB),
    Family("Llama3", "text", _hub("Llama3", **_GQA), _EMB),
    Family("Mistral", "text", _hub("Mistral", **_GQA), _EMB),
    Family("Mixtral", "text", _hub("Mixtral", **_GQA, num_experts=2, top_k=1), _EMB | {"moe"},
           note="router_aux_loss_coef=0.02 on each replica's batch"),
    Family("Gemma", "text", _hub("Gemma", **_GQA, head_dim=8), _EMB),
    Family("Gemma3", "text", _hub("Gemma3", **_GQA, head_dim=8, image_size=16,
                                  vision_encoder=None), _EMB),
    Family("Phi3", "text", _hub("Phi3", **_GQA), _EMB),
    Family("Qwen", "text", _hub("Qwen", **_GQA), _EMB),
    Family("Qwen3", "text", _hub("Qwen3", **_GQA, head_dim=8), _EMB),
    Family("QwenMoe", "text", _hub("QwenMoe", **_GQA, moe_intermediate_dim=16,
                                   shared_expert_intermediate_dim=16, num_experts=2, top_k=1),
           _EMB | {"moe"}, note="router_aux_loss_coefficient=0.001 on each replica's batch"),
    Family("Qwen3Moe", "text", _hub("Qwen3Moe", **_GQA, head_dim=8, moe_intermediate_dim=16,
                                    num_experts=2, top_k=1),
           _EMB | {"moe"}, note="router_aux_loss_coefficient=0.001 on each replica's batch"),
    Family("GptOss", "text", _hub("GptOss", **_GQA, num_experts=2, top_k=1, head_dim=8),
           _EMB | {"moe"}, note="no auxiliary loss in the backbone"),
    Family("SmolLM3", "text", _hub(
        "SmolLM3", vocabulary_size=VOCAB, hidden_dim=16, intermediate_dim=32, num_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[True], layer_types=["attention"],
        mlp_bias=False, layer_norm_epsilon=1e-5, max_position_embeddings=SEQ * 4,
        rope_theta=10000.0, partial_rotary_factor=1.0), _EMB),
    Family("RWKV7", "text", _hub("RWKV7", vocabulary_size=VOCAB, hidden_size=16, head_size=4,
                                 num_layers=1, intermediate_dim=32, gate_lora=8, mv_lora=8,
                                 aaa_lora=8, decay_lora=8), _EMB),
    # encoders
    Family("Bert", "text", _hub("Bert", **_TEXT, num_heads=2, max_sequence_length=SEQ,
                                dropout=0.0), _EMB),
    Family("DistilBert", "text", _hub("DistilBert", **_TEXT, num_heads=2,
                                      max_sequence_length=SEQ, dropout=0.0), _EMB),
    Family("Roberta", "text", _hub("Roberta", **_TEXT, num_heads=2, max_sequence_length=SEQ,
                                   dropout=0.0), _EMB),
    Family("XLMRoberta", "text", _hub("XLMRoberta", **_TEXT, num_heads=2,
                                      max_sequence_length=SEQ, dropout=0.0), _EMB),
    Family("Albert", "text", _hub("Albert", **_TEXT, num_heads=2, embedding_dim=8,
                                  max_sequence_length=SEQ), _EMB),
    Family("Electra", "text", _hub(
        "Electra", vocab_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, embedding_dim=8,
        intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ), _EMB),
    Family("DebertaV3", "text", _hub("DebertaV3", **_TEXT, num_heads=2,
                                     max_sequence_length=SEQ, bucket_size=4, dropout=0.0),
           _EMB),
    Family("FNet", "text", _hub("FNet", **_TEXT, max_sequence_length=SEQ, dropout=0.0), _EMB),
    Family("RoformerV2", "text", _hub("RoformerV2", **_TEXT, num_heads=2, head_size=8,
                                      dropout=0.0), _EMB),
    Family("ESM", "text", _hub("ESM", **_TEXT, num_heads=2, dropout=0.0,
                               max_sequence_length=SEQ), _EMB),
    Family("XLNet", "text", _hub("XLNet", **_TEXT, num_heads=2), _EMB),
    # encoder-decoder
    Family("Bart", "seq2seq", _hub("Bart", **_TEXT, num_heads=2, max_sequence_length=SEQ,
                                   dropout=0.0), _EMB),
    Family("T5", "seq2seq", _hub("T5", **_TEXT, num_heads=2, dropout=0.0), _EMB),
    Family("Whisper", "audio", _hub("Whisper", **_TEXT, num_heads=2, num_mels=8,
                                    max_encoder_sequence_length=2 * SEQ,
                                    max_decoder_sequence_length=SEQ), _EMB),
    # vision: convolutional (BatchNormalization)
    Family("ResNet", "image", _hub(
        "ResNet", input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2], block_type="basic_block", image_shape=IMAGE),
        frozenset({"batchnorm"})),
    Family("EfficientNet", "image", _hub(
        "EfficientNet", stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 2], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False],
        stackwise_width_coefficients=[1.0, 1.0], stackwise_depth_coefficients=[1.0, 1.0],
        dropout=0.0, num_features=32, input_shape=IMAGE), frozenset({"batchnorm"})),
    Family("MobileNet", "image", _hub(
        "MobileNet", stackwise_expansion=[[16], [24]], stackwise_num_blocks=[1, 1],
        stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [3]],
        stackwise_num_strides=[[2], [1]], stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"], ["hard_swish"]],
        stackwise_padding=[[1], [1]], output_num_filters=32, depthwise_filters=8,
        depthwise_stride=1, depthwise_residual=False, squeeze_and_excite=None,
        last_layer_filter=32, input_num_filters=8, image_shape=IMAGE),
        frozenset({"batchnorm"})),
    Family("DenseNet", "image", _hub("DenseNet", stackwise_num_repeats=[1, 1], growth_rate=4,
                                     image_shape=IMAGE), frozenset({"batchnorm"})),
    Family("Xception", "image", _hub("Xception", stackwise_conv_filters=[[8, 8], [16, 16]],
                                     stackwise_pooling=[False, True], image_shape=IMAGE),
           frozenset({"batchnorm"})),
    Family("CSPNet", "image", _hub(
        "CSPNet", stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_strides=2,
        stackwise_depth=[1, 1], stackwise_num_filters=[8, 16], image_shape=IMAGE,
        down_growth=True, bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5),
        expand_ratio=(2.0, 1.0), block_type="dark_block", stage_type="csp",
        stem_padding="same"), frozenset({"batchnorm"})),
    Family("HGNetV2", "image", _hub(
        "HGNetV2", depths=[1, 1], embedding_size=8, hidden_sizes=[16, 32],
        stem_channels=[3, 8, 8], hidden_act="relu", use_learnable_affine_block=False,
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, False],
        image_shape=IMAGE), frozenset({"batchnorm"})),
    Family("VGG", "image", _hub("VGG", stackwise_num_repeats=[1, 1],
                                stackwise_num_filters=[8, 16], image_shape=IMAGE)),
    # vision: transformers
    Family("ViT", "image", _hub("ViT", image_shape=IMAGE, patch_size=8, num_layers=1,
                                num_heads=2, hidden_dim=16, mlp_dim=32), _EMB),
    Family("DeiT", "image", _hub("DeiT", image_shape=IMAGE, patch_size=8, num_layers=1,
                                 num_heads=2, hidden_dim=16, intermediate_dim=32), _EMB),
    Family("SwinTransformer", "image", _hub(
        "SwinTransformer", image_shape=IMAGE, embed_dim=8, depths=(1, 1), num_heads=(1, 2),
        window_size=4, drop_path=0.0)),
    Family("DINOV2", "image", _hub(
        "DINOV2", patch_size=14, num_layers=1, hidden_dim=16, num_heads=2,
        intermediate_dim=32, image_shape=(28, 28, 3), position_embedding_shape=(28, 28, 3)),
        _EMB),
    Family("DINOV3", "image", _hub("DINOV3", patch_size=16, num_layers=1, hidden_dim=16,
                                   num_heads=2, intermediate_dim=32, image_shape=IMAGE)),
    Family("MiT", "image", _hub(
        "MiT", layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[4, 2], max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2], image_shape=IMAGE, hidden_dims=[8, 16]),
        frozenset({"dropout"}), note="attention hard-codes Dropout(0.1) in KerasHub"),
    Family("ViTDet", "image", _hub(
        "ViTDet", hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=2,
        global_attention_layer_indices=[1], image_shape=(16, 16, 3), patch_size=4,
        num_output_channels=8, window_size=2)),
]

FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILY_LIST}

# The constructor argument holding each MoE family's load-balancing loss coefficient
# (GptOss's backbone adds none).
MOE_AUX_LOSS_ARGUMENT = {"Mixtral": "router_aux_loss_coef",
                         "QwenMoe": "router_aux_loss_coefficient",
                         "Qwen3Moe": "router_aux_loss_coefficient"}


def families(*, tags: set[str] | frozenset | None = None,
             exclude: set[str] | frozenset = frozenset()
             ) -> list[Family]:
    """The families having all of `tags` and none of `exclude`."""
    return [f for f in FAMILIES.values()
            if (not tags or set(tags) <= f.tags) and not (set(exclude) & f.tags)]
