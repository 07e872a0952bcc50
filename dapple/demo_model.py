"""The model `make demo` trains: a small functional CNN with a skip connection, and synthetic
data with a learnable rule (labels from a fixed random projection), so the loss visibly falls.
It says `keras`, as a TensorFlow user writes today: Keras 3 (Keras 2.15 on TensorFlow 2.15)."""
import keras
import numpy as np


def build(num_classes: int = 10, image_size: int = 16, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((image_size, image_size, 3), name="image")
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(x)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.MaxPooling2D(name="pool1")(h)
    r = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv3")(h)
    r = keras.layers.Conv2D(32, 3, padding="same", name="conv4")(r)
    s = keras.layers.Conv2D(32, 1, name="shortcut")(h)
    h = keras.layers.Add(name="residual")([r, s])
    h = keras.layers.Activation("relu", name="relu")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
    out = keras.layers.Dense(num_classes, name="logits")(h)
    return keras.Model(x, out, name="demo_cnn")


def synthetic_data(samples: int, num_classes: int = 10, image_size: int = 16, seed: int = 1):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, image_size, image_size, 3).astype("float32")
    projection = rng.randn(image_size * image_size * 3, num_classes).astype("float32")
    y = np.argmax(x.reshape(samples, -1) @ projection, axis=1).astype("int32")
    return x, y
