"""Customizing what happens in fit().

Exercises: the end-to-end GAN (a compile() of its own, train_step, no call()).

Source: https://github.com/keras-team/keras-io/blob/master/guides/custom_train_step_in_tensorflow.py
(section "Wrapping up: an end-to-end GAN example").
Changed: MNIST (70,000 images of 28x28) -> 256 synthetic 8x8 digits; the generator maps the
latent vector to 2x2x16 and up-samples twice to 8x8 (the guide: 7x7x128 to 28x28), filters
64/128 -> 8/16, latent_dim 128 -> 16; `dataset.take(100)` -> the whole 4 batches of 64; the GAN
made and compiled under `strategy.scope()`.
"""

import keras
import tensorflow as tf
from keras import layers

from tests.programs.corpus import KERAS_IO, Outcome, Property, images, logged

SOURCE = KERAS_IO + "guides/custom_train_step_in_tensorflow.py"
COMPARE = Property(reason="random latent vectors and label noise drawn per replica",
                   trend=None)

latent_dim = 16


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        # Random points in the latent space, decoded to fake images.
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        # Noise on the labels.
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)

        # Train the discriminator.
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        # Train the generator (the discriminator's weights stay).
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def main(run):
    strategy = run.make_strategy()
    with strategy.scope():
        discriminator = keras.Sequential([
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ], name="discriminator")
        generator = keras.Sequential([
            keras.Input(shape=(latent_dim,)),
            layers.Dense(2 * 2 * 16),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((2, 2, 16)),
            layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
        ], name="generator")
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
        gan.compile(d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    all_digits, _ = images(256, seed=1)
    dataset = tf.data.Dataset.from_tensor_slices(all_digits)
    dataset = dataset.shuffle(buffer_size=1024).batch(64)
    history = gan.fit(dataset, epochs=1)
    return Outcome(models=[gan], losses=logged(history, "d_loss") + logged(history, "g_loss"))
