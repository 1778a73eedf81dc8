"""Parameter-efficient fine-tuning of Gemma with LoRA.

Exercises: a GemmaCausalLM with its preprocessor, `backbone.enable_lora(rank=4)`, SGD, weighted
metrics, fit on strings, generate.

Source: https://github.com/keras-team/keras-io/blob/master/examples/keras_recipes/parameter_efficient_finetuning_of_gemma_with_lora_and_qlora.py
(section "LoRA Fine-tuning"; the recipe's global bfloat16 dtype policy kept).
Changed: `from_preset("gemma_1.1_instruct_2b_en")` (downloaded) -> the same classes built from
config, tiny (1 layer, 2 query heads, 1 key/value head, hidden 8), random weights, the
SentencePiece model trained in memory on the data; MTNT French-English from TensorFlow
Datasets -> 16 synthetic instruction/answer pairs in the recipe's turn format,
`batch(1).take(100)` -> all 16; sequence_length 256 -> 24; generate max_length 256 -> 24;
the model made and compiled under `strategy.scope()`.
"""

import keras
import keras_hub
import tensorflow as tf

from tests.programs.corpus import (
    KERAS_IO,
    Exact,
    Outcome,
    logged,
    reviews,
    sentencepiece_proto,
)

SOURCE = KERAS_IO + (
    "examples/keras_recipes/parameter_efficient_finetuning_of_gemma_with_lora_and_qlora.py")
COMPARE = Exact(weights=1e-2, loss=1e-2)  # bfloat16 weights and activations

TEMPLATE = "<start_of_turn>user\nReview this:\n{src}<end_of_turn>\n<start_of_turn>model\n{dst}"


def main(run):
    keras.config.set_dtype_policy("bfloat16")
    strategy = run.make_strategy()
    texts, labels = reviews(16, words=6, seed=1)
    pairs = [(t, "great" if label else "awful") for t, label in zip(texts, labels)]
    train_ds = tf.data.Dataset.from_tensor_slices(
        [TEMPLATE.format(src=src, dst=dst) + "<end_of_turn>" for src, dst in pairs])
    train_ds = train_ds.batch(1).take(100)
    proto = sentencepiece_proto([TEMPLATE.format(src=s, dst=d) for s, d in pairs])

    with strategy.scope():
        tokenizer = keras_hub.models.GemmaTokenizer(proto=proto)
        preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=24)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_query_heads=2,
            num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4)
        gemma_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)
        gemma_lm.summary()
        # LoRA: the backbone's weights frozen, rank-4 adapters trained.
        gemma_lm.backbone.enable_lora(rank=4)
        gemma_lm.summary()
        optimizer = keras.optimizers.SGD(learning_rate=1e-4)
        gemma_lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         optimizer=optimizer,
                         weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    history = gemma_lm.fit(train_ds, epochs=1)
    prompt = TEMPLATE.format(src=pairs[0][0], dst="")
    outputs = gemma_lm.generate(prompt, max_length=24)
    print("Answer:\n", outputs.replace(prompt, ""))
    return Outcome(models=[gemma_lm], losses=logged(history))
