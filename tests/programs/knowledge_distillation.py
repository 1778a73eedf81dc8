"""Knowledge distillation.

Exercises: a model that overrides `compute_loss` (Keras 3's way of changing the loss while
keeping Keras's `train_step`), with a second, frozen model called inside it; a `compile`
override with extra arguments; `call` delegating to a sub-model; `keras.models.clone_model`;
a dataset size that is not a multiple of the batch (the last batch is split unevenly).

Source: https://github.com/keras-team/keras-io/blob/master/examples/vision/knowledge_distillation.py
Changed: MNIST (60,000 + 10,000 images of 28x28) -> 613 + 128 synthetic 12x12 digits; the
teacher's filters 256/512 -> 16/32, the student's 16/32 -> 4/8; epochs 5 (teacher) and 3
(distiller, student from scratch) -> 2 each; the models made, and the distiller and the
scratch student compiled, under `strategy.scope()`.
"""

import keras
from keras import layers, ops

from tests.programs.corpus import KERAS_IO, Exact, Outcome, images, logged

SOURCE = KERAS_IO + "examples/vision/knowledge_distillation.py"
COMPARE = Exact()


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def main(run):
    strategy = run.make_strategy()
    input_shape = (12, 12, 1)
    x_train, y_train = images(613, shape=input_shape, seed=1)
    x_test, y_test = images(128, shape=input_shape, seed=2)

    with strategy.scope():
        teacher = keras.Sequential([
            keras.Input(shape=input_shape),
            layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ], name="teacher")
        student = keras.Sequential([
            keras.Input(shape=input_shape),
            layers.Conv2D(4, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ], name="student")
        student_scratch = keras.models.clone_model(student)

        teacher.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
    losses = logged(teacher.fit(x_train, y_train, epochs=2))
    losses += teacher.evaluate(x_test, y_test)

    with strategy.scope():
        distiller = Distiller(student=student, teacher=teacher)
        distiller.compile(
            optimizer=keras.optimizers.Adam(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            distillation_loss_fn=keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )
    losses += logged(distiller.fit(x_train, y_train, epochs=2))
    losses += distiller.evaluate(x_test, y_test)

    with strategy.scope():
        student_scratch.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
    losses += logged(student_scratch.fit(x_train, y_train, epochs=2))
    losses += student_scratch.evaluate(x_test, y_test)
    return Outcome(models=[teacher, student, student_scratch], losses=losses)
