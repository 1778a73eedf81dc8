"""Structured data classification with FeatureSpace.

Exercises: string, integer and float features, crosses, a training model and an inference model
on raw dicts.

Source: https://github.com/keras-team/keras-io/blob/master/examples/structured_data/structured_data_classification_with_feature_space.py
Changed: the Cleveland heart-disease CSV (303 rows) -> 200 synthetic rows with the same columns
and kinds (the target depends on a few of them); epochs 20 -> 3; the FeatureSpace and the
models made under `strategy.scope()`, as the preprocessing-layers guide advises for
tf.distribute.
"""

import keras
import numpy as np
import pandas as pd
import tensorflow as tf
from keras.utils import FeatureSpace

from tests.programs.corpus import KERAS_IO, Outcome, Property, logged

SOURCE = KERAS_IO + (
    "examples/structured_data/structured_data_classification_with_feature_space.py")
COMPARE = Property(reason="Dropout: each replica draws its own mask")


def heart_like(n, seed=0):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "age": rng.integers(29, 78, n), "sex": rng.integers(0, 2, n),
        "cp": rng.integers(0, 5, n), "trestbps": rng.integers(94, 200, n),
        "chol": rng.integers(126, 564, n), "fbs": rng.integers(0, 2, n),
        "restecg": rng.integers(0, 3, n), "thalach": rng.integers(71, 202, n),
        "exang": rng.integers(0, 2, n), "oldpeak": np.round(rng.uniform(0, 6.2, n), 1),
        "slope": rng.integers(1, 4, n), "ca": rng.integers(0, 4, n),
        "thal": rng.choice(["fixed", "normal", "reversible"], n),
    })
    risk = (frame["cp"] >= 3).astype(int) + (frame["thal"] == "reversible") + frame["exang"]
    frame["target"] = (risk + rng.integers(0, 2, n) >= 2).astype(int)
    return frame


def dataframe_to_dataset(dataframe):
    dataframe = dataframe.copy()
    labels = dataframe.pop("target")
    ds = tf.data.Dataset.from_tensor_slices((dict(dataframe), labels))
    return ds.shuffle(buffer_size=len(dataframe))


def main(run):
    strategy = run.make_strategy()
    dataframe = heart_like(200)
    val_dataframe = dataframe.sample(frac=0.2, random_state=1337)
    train_dataframe = dataframe.drop(val_dataframe.index)
    train_ds = dataframe_to_dataset(train_dataframe).batch(32)
    val_ds = dataframe_to_dataset(val_dataframe).batch(32)

    with strategy.scope():
        feature_space = FeatureSpace(
            features={
                # Categorical features encoded as integers.
                "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
                "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
                "fbs": FeatureSpace.integer_categorical(num_oov_indices=0),
                "restecg": FeatureSpace.integer_categorical(num_oov_indices=0),
                "exang": FeatureSpace.integer_categorical(num_oov_indices=0),
                "ca": FeatureSpace.integer_categorical(num_oov_indices=0),
                # A categorical feature encoded as a string.
                "thal": FeatureSpace.string_categorical(num_oov_indices=0),
                # A numerical feature discretized.
                "age": FeatureSpace.float_discretized(num_bins=30),
                # Numerical features to normalize.
                "trestbps": FeatureSpace.float_normalized(),
                "chol": FeatureSpace.float_normalized(),
                "thalach": FeatureSpace.float_normalized(),
                "oldpeak": FeatureSpace.float_normalized(),
                "slope": FeatureSpace.float_normalized(),
            },
            crosses=[
                FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=64),
                FeatureSpace.cross(feature_names=("thal", "ca"), crossing_dim=16),
            ],
            output_mode="concat",
        )
    train_ds_with_no_labels = train_ds.map(lambda x, _: x)
    feature_space.adapt(train_ds_with_no_labels)
    preprocessed_train_ds = train_ds.map(
        lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)
    preprocessed_val_ds = val_ds.map(
        lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)

    with strategy.scope():
        dict_inputs = feature_space.get_inputs()
        encoded_features = feature_space.get_encoded_features()
        x = keras.layers.Dense(32, activation="relu")(encoded_features)
        x = keras.layers.Dropout(0.5)(x)
        predictions = keras.layers.Dense(1, activation="sigmoid")(x)
        training_model = keras.Model(inputs=encoded_features, outputs=predictions)
        training_model.compile(optimizer="adam", loss="binary_crossentropy",
                               metrics=["accuracy"])
        inference_model = keras.Model(inputs=dict_inputs, outputs=predictions)
    history = training_model.fit(preprocessed_train_ds, epochs=3,
                                 validation_data=preprocessed_val_ds, verbose=2)

    # Inference on one raw sample (strings and numbers).
    sample = {"age": 60, "sex": 1, "cp": 1, "trestbps": 145, "chol": 233, "fbs": 1,
              "restecg": 2, "thalach": 150, "exang": 0, "oldpeak": 2.3, "slope": 3, "ca": 0,
              "thal": "fixed"}
    input_dict = {name: keras.ops.convert_to_tensor([value]) for name, value in sample.items()}
    probability = inference_model.predict(input_dict)
    print(f"This particular patient had a {100 * float(probability[0][0]):.2f}% probability "
          "of having a heart disease, as evaluated by our model.")
    return Outcome(models=[training_model], losses=logged(history) + logged(history, "val_loss"),
                   trend=logged(history))
