"""KerasHub task models fine-tuned as KerasHub's guides do, tiny and offline.

    from tests.programs.kerashub import tasks

    task = tasks.TASKS["gpt2_lora"]
    with strategy.scope():
        model = task.build()          # tokenizer, preprocessor, backbone, task; LoRA enabled
        task.compile(model)           # the guide's optimizer, loss and metrics
    model.fit(task.x(), task.y(), batch_size=tasks.GLOBAL_BATCH)   # strings (or images) in

Every tokenizer is built in memory: a vocabulary dict and BPE merges (GPT-2,
BART), a WordPiece vocabulary list (BERT), a SentencePiece model trained on
the task's own sentences (Gemma). Backbones come from their constructors with
one or two layers and widths of 16-32; dropout is 0 wherever a config has it,
so a run is a deterministic function of the seed, the data and the global
batch. Nothing is downloaded.

Tasks (as KerasHub's fine-tuning guides build them, with their preprocessors):
  gpt2_lora    GPT2CausalLM + GPT2CausalLMPreprocessor, backbone.enable_lora(4)
  bert_classifier  BertTextClassifier + its preprocessor (WordPiece)
  bart_seq2seq BartSeq2SeqLM + BartSeq2SeqLMPreprocessor (BPE)
  gemma_lora   GemmaCausalLM + GemmaCausalLMPreprocessor (SentencePiece),
               backbone.enable_lora(4)
  bert_masked_lm   BertMaskedLM + BertMaskedLMPreprocessor (its random masks are
               drawn from the global seed `build` sets, the same in every run)
  vit_classifier, resnet_classifier   ViT / ResNet ImageClassifier on images
"""

from __future__ import annotations

import dataclasses
import io
from typing import Callable

import keras

GLOBAL_BATCH = 8
STEPS = 3
SEQ = 8
LORA_RANK = 4
CLASSES = 3
IMAGE = (32, 32, 3)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "cat", "sat",
         "on", "mat", "red", "sun")


def sentences(n: int, *, seed: int = 0) -> list[str]:
    """n sentences of 3-6 words from WORDS (so every token is known to every tokenizer)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 7)))) for _ in range(n)]


def byte_pair_vocabulary(specials: tuple[str, ...]) -> tuple[dict, list]:
    """A byte-level BPE vocabulary (dict) and merges in which every word of WORDS is one token.

    Each word, alone and with GPT-2's space marker "Ġ", is merged left to right
    from its characters; the specials come first.
    """
    vocabulary = {token: i for i, token in enumerate(specials)}
    merges: list[str] = []
    for char in sorted(set("".join(WORDS)) | {"Ġ"}):
        vocabulary.setdefault(char, len(vocabulary))
    for word in WORDS:
        for token in (word, "Ġ" + word):
            pieces = list(token)
            while len(pieces) > 1:
                merge = f"{pieces[0]} {pieces[1]}"
                if merge not in merges:
                    merges.append(merge)
                pieces = [pieces[0] + pieces[1]] + pieces[2:]
                vocabulary.setdefault(pieces[0], len(vocabulary))
    return vocabulary, merges


def sentencepiece_proto() -> bytes:
    """A SentencePiece model (word pieces) trained in memory on the task sentences."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(200, seed=1)), model_writer=model,
        vocab_size=len(WORDS) + 4, model_type="WORD", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>",
        minloglevel=2)
    return model.getvalue()


@dataclasses.dataclass(frozen=True)
class Task:
    """One KerasHub task as a guide fine-tunes it.

    Attributes:
      name: the key in TASKS.
      make: builds the task model (random weights, LoRA enabled where `lora`).
      x: the training inputs as the guide passes them (strings, a dict of
        strings, or images), GLOBAL_BATCH * STEPS examples.
      y: the labels, or None where the preprocessor makes them (language models).
      lora: True if the backbone's LoRA is enabled (its base weights frozen).
      prompts: generate() inputs after training (language models), or None.
      note: what the comparison of this task must know.
    """

    name: str
    make: Callable[[], keras.Model]
    x: Callable[[], object]
    y: Callable[[], object] | None = None
    lora: bool = False
    prompts: tuple | None = None
    note: str = ""

    def build(self, *, seed: int = 0) -> keras.Model:
        """The task model; the same seed gives the same weights (keras.utils.set_random_seed)."""
        keras.utils.set_random_seed(seed)
        model = self.make()
        if self.lora:
            model.backbone.enable_lora(LORA_RANK)
        return model

    def compile(self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None):
        """The guides' compile: Adam, their loss and metric, greedy sampling for generate()."""
        optimizer = optimizer or keras.optimizers.Adam(5e-3)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if self.prompts is not None:  # generative: greedy, so generate() is deterministic
            model.compile(optimizer=optimizer, loss=loss, weighted_metrics=["accuracy"],
                          sampler="greedy")
        elif self.y is None:  # the preprocessor makes labels and sample weights
            model.compile(optimizer=optimizer, loss=loss, weighted_metrics=["accuracy"])
        else:
            model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
        return model

    def fit(self, model: keras.Model) -> keras.Model:
        y = self.y() if self.y is not None else None
        model.fit(self.x(), y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        return model


def _examples() -> int:
    return GLOBAL_BATCH * STEPS


def _labels():
    import numpy as np

    return np.random.default_rng(2).integers(0, CLASSES, size=_examples()).astype("int32")


def _images():
    import numpy as np

    return np.random.default_rng(3).uniform(0, 1, size=(_examples(), *IMAGE)).astype("float32")


def _gpt2():
    import keras_hub

    vocabulary, merges = byte_pair_vocabulary(("<|endoftext|>",))
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=SEQ)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=2 * SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def _bert_tokenizer():
    import keras_hub

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return keras_hub.models.BertTokenizer(vocabulary=vocabulary)


def _bert_backbone(tokenizer):
    import keras_hub

    return keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0)


def _bert_classifier():
    import keras_hub

    tokenizer = _bert_tokenizer()
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer,
                                                                   sequence_length=SEQ)
    return keras_hub.models.BertTextClassifier(_bert_backbone(tokenizer), num_classes=CLASSES,
                                               preprocessor=preprocessor, dropout=0.0)


def _bert_masked_lm():
    import keras_hub

    tokenizer = _bert_tokenizer()
    preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
        tokenizer, sequence_length=SEQ, mask_selection_rate=0.3, mask_selection_length=3)
    return keras_hub.models.BertMaskedLM(_bert_backbone(tokenizer), preprocessor=preprocessor)


def _bart():
    import keras_hub

    vocabulary, merges = byte_pair_vocabulary(("<s>", "<pad>", "</s>", "<unk>"))
    tokenizer = keras_hub.models.BartTokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.BartSeq2SeqLMPreprocessor(
        tokenizer, encoder_sequence_length=SEQ, decoder_sequence_length=SEQ)
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=preprocessor)


def _bart_x():
    return {"encoder_text": sentences(_examples(), seed=4),
            "decoder_text": sentences(_examples(), seed=5)}


def _gemma():
    import keras_hub

    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=SEQ)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=16, dropout=0.0)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)


def _vit():
    import keras_hub

    backbone = keras_hub.models.ViTBackbone(image_shape=IMAGE, patch_size=8, num_layers=1,
                                            num_heads=2, hidden_dim=16, mlp_dim=32)
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=CLASSES)


def _resnet():
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=IMAGE)
    return keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=CLASSES)


_PROMPTS = ("the quick", "a lazy cat")

TASKS: dict[str, Task] = {task.name: task for task in (
    Task("gpt2_lora", _gpt2, lambda: sentences(_examples()), lora=True, prompts=_PROMPTS),
    Task("bert_classifier", _bert_classifier, lambda: sentences(_examples(), seed=6), _labels),
    Task("bart_seq2seq", _bart, _bart_x, prompts=_PROMPTS),
    Task("gemma_lora", _gemma, lambda: sentences(_examples(), seed=7), lora=True,
         prompts=_PROMPTS),
    Task("bert_masked_lm", _bert_masked_lm, lambda: sentences(_examples(), seed=8)),
    Task("vit_classifier", _vit, _images, _labels),
    Task("resnet_classifier", _resnet, _images, _labels,
         note="BatchNormalization: each replica normalises with its own batch's statistics, "
              "so the reference is one device only with sync_batch_norm=True"),
)}
