"""Parameter-efficient fine-tuning of GPT-2 with LoRA.

Exercises: the global mixed_float16 policy (compile wraps the optimizer in a
LossScaleOptimizer); AdamW with weight decay, epsilon and `global_clipnorm`, biases and
LayerNorm's gamma and beta excluded from the decay by name; a full fine-tune of a GPT2CausalLM
on raw strings; then a hand-written `LoraLayer` swapped into every attention layer's private
query and value projections (`_tracker.locked = False`), everything but the LoRA layers frozen
by walking `_flatten_layers()`, the LoRA model fine-tuned with a fresh optimizer of the same
kind, its adapters merged into the frozen kernels with `assign_add`, the original projections
put back, and text generated from the merged model.

Source: https://github.com/keras-team/keras-io/blob/master/examples/nlp/parameter_efficient_finetuning_of_gpt2_with_lora.py
Changed: `GPT2CausalLM.from_preset("gpt2_base_en")` with its preprocessor (downloaded) -> the
same classes built from config, tiny (2 layers, 2 heads, hidden 8, sequence length 16),
random weights, dropout 0.1 -> 0 (so the run is deterministic), a byte-level BPE vocabulary
and merges held in memory; Reddit TIFU from TensorFlow Datasets (`take(500)` batches of 32)
-> 64 synthetic reviews in batches of 8; the learning rate 5e-5 -> 5e-3 (8 steps, not 500);
max_length 200 -> 16; the GPU memory callback keeps its hooks but records the batches it
would have measured (`tf.config.experimental.get_memory_info("GPU:0")` needs a GPU), and the
matplotlib plot of those figures is dropped; the models made, the LoRA layers injected and
built, and the models compiled under `strategy.scope()`, where a user swapping in a strategy
puts them; `global_clipnorm` 1.0 -> 0.25, so that clipping acts: this tiny model's gradients
have global norms of 0.4 to 0.6 (measured on one device at its initial weights, batch by batch),
which 1.0 would never clip.
"""

import math

import keras
import keras_hub
import tensorflow as tf

from tests.programs.corpus import (
    KERAS_IO,
    Exact,
    Outcome,
    gpt2_vocabulary,
    logged,
    reviews,
    word_vocabulary,
)

SOURCE = KERAS_IO + "examples/nlp/parameter_efficient_finetuning_of_gpt2_with_lora.py"
COMPARE = Exact(weights=1e-3, loss=1e-3)  # mixed_float16: float16 activations

BATCH_SIZE = 8
EPOCHS = 1
MAX_SEQUENCE_LENGTH = 16
MAX_GENERATION_LENGTH = 16
# LoRA-specific hyperparameters
RANK = 4
ALPHA = 32.0


class GPUMemoryCallback(keras.callbacks.Callback):
    """The source's callback, its hooks as written; it records where it would measure."""

    def __init__(self, target_batches, print_stats=False, **kwargs):
        super().__init__(**kwargs)
        self.target_batches = target_batches
        self.print_stats = print_stats
        self.labels = []

    def on_epoch_begin(self, epoch, logs=None):
        self.labels.append(f"epoch {epoch} start")

    def on_train_batch_begin(self, batch, logs=None):
        if batch in self.target_batches:
            self.labels.append(f"batch {batch}")

    def on_epoch_end(self, epoch, logs=None):
        self.labels.append(f"epoch {epoch} end")


def generate_text(model, input_text, max_length=200):
    output = model.generate(input_text, max_length=max_length)
    print("\nOutput:")
    print(output)


def get_optimizer_and_loss():
    optimizer = keras.optimizers.AdamW(
        learning_rate=5e-3,
        weight_decay=0.01,
        epsilon=1e-6,
        global_clipnorm=0.25,  # Gradient clipping.
    )
    # Exclude layernorm and bias terms from weight decay.
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.exclude_from_weight_decay(var_names=["gamma"])
    optimizer.exclude_from_weight_decay(var_names=["beta"])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return optimizer, loss


class LoraLayer(keras.layers.Layer):
    def __init__(self, original_layer, rank=8, alpha=32, trainable=False, **kwargs):
        # We want to keep the name of this layer the same as the original dense layer.
        original_layer_config = original_layer.get_config()
        name = original_layer_config["name"]
        kwargs.pop("name", None)
        super().__init__(name=name, trainable=trainable, **kwargs)

        self.rank = rank
        self.alpha = alpha
        self._scale = alpha / rank
        self._num_heads = original_layer_config["output_shape"][-2]
        self._hidden_dim = self._num_heads * original_layer_config["output_shape"][-1]

        # Original dense layer; frozen whether training or not.
        self.original_layer = original_layer
        self.original_layer.trainable = False

        # LoRA dense layers.
        self.A = keras.layers.Dense(
            units=rank,
            use_bias=False,
            kernel_initializer=keras.initializers.VarianceScaling(
                scale=math.sqrt(5), mode="fan_in", distribution="uniform"),
            trainable=trainable,
            name="lora_A",
        )
        # B has the same `equation` and `output_shape` as the original layer.
        self.B = keras.layers.EinsumDense(
            equation=original_layer_config["equation"],
            output_shape=original_layer_config["output_shape"],
            kernel_initializer="zeros",
            trainable=trainable,
            name="lora_B",
        )

    def call(self, inputs):
        original_output = self.original_layer(inputs)
        if self.trainable:
            lora_output = self.B(self.A(inputs)) * self._scale
            return original_output + lora_output
        return original_output


def make_gpt2(strategy, tokenizer):
    with strategy.scope():
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
            tokenizer, sequence_length=MAX_SEQUENCE_LENGTH)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=2,
            hidden_dim=8, intermediate_dim=16, max_sequence_length=MAX_SEQUENCE_LENGTH,
            dropout=0.0)
        return preprocessor, keras_hub.models.GPT2CausalLM(backbone=backbone,
                                                          preprocessor=preprocessor)


def main(run):
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = run.make_strategy()
    vocabulary, merges = gpt2_vocabulary(word_vocabulary())
    with strategy.scope():
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)

    texts, _ = reviews(64, seed=1)
    train_ds = (tf.data.Dataset.from_tensor_slices(texts).batch(BATCH_SIZE).cache()
                .prefetch(tf.data.AUTOTUNE))

    # Fine-tune GPT-2.
    _, gpt2_lm = make_gpt2(strategy, tokenizer)
    gpt2_lm.summary()
    gpu_memory_callback = GPUMemoryCallback(target_batches=[1, 2, 4, 6], print_stats=True)
    optimizer, loss = get_optimizer_and_loss()
    with strategy.scope():
        gpt2_lm.compile(optimizer=optimizer, loss=loss, weighted_metrics=["accuracy"])
    history = gpt2_lm.fit(train_ds, epochs=EPOCHS, callbacks=[gpu_memory_callback])
    losses = logged(history)
    generate_text(gpt2_lm, "the movie was", max_length=MAX_GENERATION_LENGTH)

    # LoRA GPT-2: a new model, its query and value projections wrapped.
    preprocessor, lora_model = make_gpt2(strategy, tokenizer)
    with strategy.scope():
        for layer_idx in range(lora_model.backbone.num_layers):
            decoder_layer = lora_model.backbone.get_layer(f"transformer_layer_{layer_idx}")
            self_attention_layer = decoder_layer._self_attention_layer
            # Allow mutation to Keras layer state.
            self_attention_layer._tracker.locked = False
            self_attention_layer._query_dense = LoraLayer(
                self_attention_layer._query_dense, rank=RANK, alpha=ALPHA, trainable=True)
            self_attention_layer._value_dense = LoraLayer(
                self_attention_layer._value_dense, rank=RANK, alpha=ALPHA, trainable=True)
        # A forward pass builds the LoRA layers.
        lora_model(preprocessor(["the movie was a fun story"])[0])

    # Freeze the entire LLM, only the LoRA layers should be trainable.
    for layer in lora_model._flatten_layers():
        lst_of_sublayers = list(layer._flatten_layers())
        if len(lst_of_sublayers) == 1:  # "leaves of the model"
            layer.trainable = layer.name in ["lora_A", "lora_B"]
    lora_model.summary()

    gpu_memory_callback = GPUMemoryCallback(target_batches=[1, 2, 4, 6], print_stats=True)
    optimizer, loss = get_optimizer_and_loss()
    with strategy.scope():
        lora_model.compile(optimizer=optimizer, loss=loss, weighted_metrics=["accuracy"])
    history = lora_model.fit(train_ds, epochs=EPOCHS, callbacks=[gpu_memory_callback])
    losses += logged(history)

    # Merge weights and generate text.
    for layer_idx in range(lora_model.backbone.num_layers):
        self_attention_layer = lora_model.backbone.get_layer(
            f"transformer_layer_{layer_idx}")._self_attention_layer
        for attribute in ("_query_dense", "_value_dense"):
            lora_layer = getattr(self_attention_layer, attribute)
            A_weights = lora_layer.A.kernel
            B_weights = lora_layer.B.kernel
            increment_weights = tf.einsum("ab,bcd->acd", A_weights, B_weights) * (ALPHA / RANK)
            lora_layer.original_layer.kernel.assign_add(increment_weights)
            # Put back in place the original layer with updated weights.
            setattr(self_attention_layer, attribute, lora_layer.original_layer)
    generate_text(lora_model, "the movie was", max_length=MAX_GENERATION_LENGTH)
    generate_text(lora_model, "this film is", max_length=MAX_GENERATION_LENGTH)
    return Outcome(models=[gpt2_lm, lora_model], losses=losses)
