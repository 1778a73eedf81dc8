"""Variational AutoEncoder: a Model subclass with train_step and no call(), its own loss trackers.

Source: https://github.com/keras-team/keras-io/blob/master/examples/generative/vae.py
Changed: MNIST (70,000 images of 28x28) -> 512 synthetic 8x8 digits; the encoder's convolutions
down-sample 8x8 to 2x2 (the example: 28x28 to 7x7) and the decoder up-samples back, filters
32/64 -> 8/16; epochs 30 -> 3; the VAE made and compiled under `strategy.scope()`.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

from tests.programs.corpus import KERAS_IO, Outcome, Property, images, logged

SOURCE = KERAS_IO + "examples/generative/vae.py"
COMPARE = Property(reason="the sampling noise is drawn per replica")


class Sampling(layers.Layer):
    """Samples z from (z_mean, z_log_var)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def main(run):
    strategy = run.make_strategy()
    latent_dim = 2
    with strategy.scope():
        encoder_inputs = keras.Input(shape=(8, 8, 1))
        x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
        x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Flatten()(x)
        x = layers.Dense(16, activation="relu")(x)
        z_mean = layers.Dense(latent_dim, name="z_mean")(x)
        z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
        z = Sampling()([z_mean, z_log_var])
        encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

        latent_inputs = keras.Input(shape=(latent_dim,))
        x = layers.Dense(2 * 2 * 16, activation="relu")(latent_inputs)
        x = layers.Reshape((2, 2, 16))(x)
        x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
        x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
        decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
        decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

        vae = VAE(encoder, decoder)
        vae.compile(optimizer=keras.optimizers.Adam())
    mnist_digits, _ = images(512, seed=1)
    mnist_digits = np.asarray(mnist_digits, "float32")
    history = vae.fit(mnist_digits, epochs=3, batch_size=128)
    return Outcome(models=[vae], losses=logged(history))
