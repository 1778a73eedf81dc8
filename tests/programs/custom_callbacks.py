"""Writing your own callbacks.

Exercises: every hook, the logs dict, early stopping at the minimum loss, a learning-rate
scheduler.

Source: https://github.com/keras-team/keras-io/blob/master/guides/writing_your_own_callbacks.py
Changed: MNIST (1,000 + 1,000 images of 784 pixels) -> 256 + 128 synthetic digits of 64 features
(the regression target is the digit, as in the guide); epochs 30 -> 6 (early stopping) and
15 -> 13 (the schedule's last change is at epoch 12); steps_per_epoch 5 -> 2; the model made
and compiled under `strategy.scope()`; the hooks' prints kept.
"""

import keras
import numpy as np

from tests.programs.corpus import KERAS_IO, Exact, Outcome, digits, logged

SOURCE = KERAS_IO + "guides/writing_your_own_callbacks.py"
COMPARE = Exact()


def get_model():
    model = keras.Sequential()
    model.add(keras.layers.Dense(1))
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=0.1),
                  loss="mean_squared_error", metrics=["mean_absolute_error"])
    return model


class CustomCallback(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print("Starting training; got log keys: {}".format(list(logs.keys())))

    def on_train_end(self, logs=None):
        print("Stop training; got log keys: {}".format(list(logs.keys())))

    def on_epoch_begin(self, epoch, logs=None):
        print("Start epoch {} of training; got log keys: {}".format(epoch, list(logs.keys())))

    def on_epoch_end(self, epoch, logs=None):
        print("End epoch {} of training; got log keys: {}".format(epoch, list(logs.keys())))

    def on_test_begin(self, logs=None):
        print("Start testing; got log keys: {}".format(list(logs.keys())))

    def on_test_end(self, logs=None):
        print("Stop testing; got log keys: {}".format(list(logs.keys())))

    def on_predict_begin(self, logs=None):
        print("Start predicting; got log keys: {}".format(list(logs.keys())))

    def on_predict_end(self, logs=None):
        print("Stop predicting; got log keys: {}".format(list(logs.keys())))

    def on_train_batch_begin(self, batch, logs=None):
        print("...Training: start of batch {}; got log keys: {}".format(batch, list(logs.keys())))

    def on_train_batch_end(self, batch, logs=None):
        print("...Training: end of batch {}; got log keys: {}".format(batch, list(logs.keys())))

    def on_test_batch_begin(self, batch, logs=None):
        print("...Evaluating: start of batch {}; got log keys: {}".format(batch, list(logs.keys())))

    def on_test_batch_end(self, batch, logs=None):
        print("...Evaluating: end of batch {}; got log keys: {}".format(batch, list(logs.keys())))

    def on_predict_batch_begin(self, batch, logs=None):
        print("...Predicting: start of batch {}; got log keys: {}".format(batch, list(logs.keys())))

    def on_predict_batch_end(self, batch, logs=None):
        print("...Predicting: end of batch {}; got log keys: {}".format(batch, list(logs.keys())))


class LossAndErrorPrintingCallback(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"]))

    def on_test_batch_end(self, batch, logs=None):
        print("Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        print("The average loss for epoch {} is {:7.2f} and mean absolute error is {:7.2f}."
              .format(epoch, logs["loss"], logs["mean_absolute_error"]))


class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    """Stops training when the loss is at its minimum, and restores the best weights."""

    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = np.inf

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                print("Restoring model weights from the end of the best epoch.")
                self.model.set_weights(self.best_weights)

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")


class CustomLearningRateScheduler(keras.callbacks.Callback):
    """Sets the learning rate from `schedule(epoch, lr)` before each epoch."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model.optimizer, "learning_rate"):
            raise ValueError('Optimizer must have a "learning_rate" attribute.')
        lr = self.model.optimizer.learning_rate
        scheduled_lr = self.schedule(epoch, lr)
        self.model.optimizer.learning_rate = scheduled_lr
        print(f"\nEpoch {epoch}: Learning rate is {float(np.array(scheduled_lr))}.")


LR_SCHEDULE = [(3, 0.05), (6, 0.01), (9, 0.005), (12, 0.001)]


def lr_schedule(epoch, lr):
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


def main(run):
    strategy = run.make_strategy()
    x_train, y_train = digits(256, seed=1)
    x_test, y_test = digits(128, seed=2)
    y_train, y_test = y_train.astype("float32"), y_test.astype("float32")
    losses, models = [], []

    with strategy.scope():
        model = get_model()
    history = model.fit(x_train, y_train, batch_size=128, epochs=1, verbose=0,
                        validation_split=0.5, callbacks=[CustomCallback()])
    losses += logged(history) + logged(history, "val_loss")
    losses.append(model.evaluate(x_test, y_test, batch_size=128, verbose=0,
                                 callbacks=[CustomCallback()])[0])
    model.predict(x_test, batch_size=128, callbacks=[CustomCallback()])
    models.append(model)

    with strategy.scope():
        model = get_model()
    losses += logged(model.fit(x_train, y_train, batch_size=128, epochs=2, verbose=0,
                               callbacks=[LossAndErrorPrintingCallback()]))
    losses.append(model.evaluate(x_test, y_test, batch_size=128, verbose=0,
                                 callbacks=[LossAndErrorPrintingCallback()])[0])
    models.append(model)

    with strategy.scope():
        model = get_model()
    losses += logged(model.fit(x_train, y_train, batch_size=64, steps_per_epoch=2, epochs=6,
                               verbose=0, callbacks=[LossAndErrorPrintingCallback(),
                                                     EarlyStoppingAtMinLoss()]))
    models.append(model)

    with strategy.scope():
        model = get_model()
    losses += logged(model.fit(x_train, y_train, batch_size=64, steps_per_epoch=2, epochs=13,
                               verbose=0, callbacks=[LossAndErrorPrintingCallback(),
                                                     CustomLearningRateScheduler(lr_schedule)]))
    models.append(model)
    return Outcome(models=models, losses=losses)
