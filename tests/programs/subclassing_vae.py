"""Making new layers and models via subclassing.

Exercises: the end-to-end VAE (layers nesting layers, add_loss in call()).

Source: https://github.com/keras-team/keras-io/blob/master/guides/making_new_layers_and_models_via_subclassing.py
(section "Putting it all together: an end-to-end example", trained with fit as the guide's
last cell does).
Changed: MNIST (60,000 images of 784 pixels) -> 512 synthetic digits of 64 features;
intermediate_dim 64 -> 16, latent_dim 32 -> 4; epochs 2 -> 2; the model made and compiled
under `strategy.scope()`.
"""

import keras
from keras import layers, ops

from tests.programs.corpus import KERAS_IO, Outcome, Property, digits, logged

SOURCE = KERAS_IO + "guides/making_new_layers_and_models_via_subclassing.py"
COMPARE = Property(reason="the sampling noise is drawn per replica")


class Sampling(layers.Layer):
    """Samples z, the vector encoding a digit, from (z_mean, z_log_var)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(layers.Layer):
    """Maps digits to a triplet (z_mean, z_log_var, z)."""

    def __init__(self, latent_dim=32, intermediate_dim=64, name="encoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = layers.Dense(latent_dim)
        self.dense_log_var = layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean = self.dense_mean(x)
        z_log_var = self.dense_log_var(x)
        z = self.sampling((z_mean, z_log_var))
        return z_mean, z_log_var, z


class Decoder(layers.Layer):
    """Converts z back into a readable digit."""

    def __init__(self, original_dim, intermediate_dim=64, name="decoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_output = layers.Dense(original_dim, activation="sigmoid")

    def call(self, inputs):
        x = self.dense_proj(inputs)
        return self.dense_output(x)


class VariationalAutoEncoder(keras.Model):
    """Combines the encoder and decoder into an end-to-end model for training."""

    def __init__(self, original_dim, intermediate_dim=64, latent_dim=32, name="autoencoder",
                 **kwargs):
        super().__init__(name=name, **kwargs)
        self.original_dim = original_dim
        self.encoder = Encoder(latent_dim=latent_dim, intermediate_dim=intermediate_dim)
        self.decoder = Decoder(original_dim, intermediate_dim=intermediate_dim)

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        # The KL divergence regularization loss.
        kl_loss = -0.5 * ops.mean(z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1)
        self.add_loss(kl_loss)
        return reconstructed


def main(run):
    strategy = run.make_strategy()
    x_train, _ = digits(512, seed=1)
    original_dim = 64
    with strategy.scope():
        vae = VariationalAutoEncoder(original_dim, 16, 4)
        optimizer = keras.optimizers.Adam(learning_rate=1e-3)
        vae.compile(optimizer, loss=keras.losses.MeanSquaredError())
    history = vae.fit(x_train, x_train, epochs=2, batch_size=64)
    return Outcome(models=[vae], losses=logged(history))
