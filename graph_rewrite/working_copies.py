"""Per device, a working copy of a stage's trainable variables, for the stage's calls there.

Where a unit runs in another process than the one holding the model's variables (the
TensorFlow-cluster runtime: the user's script made them on the chief), every call of the stage
would read each weight across the network, once per micro-batch and again in its backward.
With working copies, the step copies each weight to the unit's device once, at its start
(`refresh`), and the stage's calls there read the copy; their gradients are taken with respect
to the copy and handed back as the variable's (the optimizer still updates the model's own
variables, so checkpoints and `model.variables` need nothing gathered).

The layers read the copies the way `batch_statistics.ScratchStatistics` redirects moving
statistics: while a call is traced, every attribute of the stage's layers (and their sublayers)
that holds one of the variables holds the copy instead, set past Keras's attribute tracking and
put back on exit; the copies reach the traced function as arguments, so one trace serves every
device. Which attributes a call reads is its Keras's (`keras_adapter`: tf_keras's public ones;
Keras 3's Dense keeps its kernel in `_kernel`), and the copies are plain `tf.Variable`s (a
Keras 3 `keras.Variable` wraps one). A stage is only given copies when every one of its
trainable variables is such an attribute, read as a plain copy would be (not cast by Keras 3's
mixed precision), and it has no weight regularizer (whose penalty reads the variable itself):
otherwise its calls read the variables where they live, which is slower, never wrong.

A runtime may also keep the stage's weights on one device (`keep_on`): the copies there are
then the stage's current weights, trained there by the optimizer, and the others are refreshed
from them; the variables are brought up to date only when asked (`store_home`). It may train
other devices' copies in place too (`train_on`: a replica's, given the same updates). Trained
copies take the variables' values again when those may have changed (`load_trained`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graph_rewrite.keras_adapter import for_model, tf_variables

Slot = Tuple[object, str]          # (layer, attribute name)


def _slots(layers, variables) -> Dict[int, List[Slot]]:
    """By id(variable): the (layer, attribute) pairs that hold it, over layers and sublayers,
    where the layer's Keras reads it (`weight_holders`, `reads_through` of its adapter)."""
    wanted = {id(v) for v in variables}
    found: Dict[int, List[Slot]] = {}
    seen = set()
    for top in layers:
        keras = for_model(top)
        for layer in keras.weight_holders(top):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            for name, value in list(vars(layer).items()):
                if id(value) in wanted and keras.reads_through(name):
                    found.setdefault(id(value), []).append((layer, name))
    return found


class WorkingCopies:
    def __init__(self, layers: Sequence, variables: Sequence[tf.Variable], penalized: bool):
        self.variables = list(variables)
        self._values = tf_variables(self.variables)     # the tf.Variables (Keras 3 wraps one)
        self._slots = _slots(layers, self.variables)
        # Copies are only safe when every read of a variable goes through an attribute, and
        # reads a plain tf.Variable as it would the variable.
        self.possible = (bool(self.variables) and not penalized
                         and all(id(v) in self._slots for v in self.variables)
                         and all(for_model(layer).copy_reads_alike(layer, v)
                                 for v in self.variables for layer, _ in self._slots[id(v)]))
        self._by_device: Dict[str, List[tf.Variable]] = {}
        self.home: Optional[str] = None       # whose copies stand for the variables (`keep_on`)
        self.trained: List[str] = []          # devices whose copies the optimizer updates

    def make(self, device: str) -> None:
        """Give `device` copies (eagerly: a `tf.function` that creates variables traces twice),
        unless the stage cannot have them or the variables already live there."""
        if not self.possible or device in self._by_device or all(
                _lives_on(v, device) for v in self._values):
            return
        with tf.init_scope(), tf.device(device):
            self._by_device[device] = [_copy_of(v, value)
                                       for v, value in zip(self.variables, self._values)]

    def on(self, device: str) -> List[tf.Variable]:
        return self._by_device.get(device, [])

    def variables_on(self, device: str) -> List[tf.Variable]:
        """What the stage's calls on `device` read: its copies, else the variables."""
        return self.on(device) or self.variables

    def keep_on(self, device: str) -> bool:
        """Make the copies on `device` the stage's current weights, if it has copies there."""
        if self.on(device):
            self.home = device
            self.train_on(device)
        return self.home == device

    def train_on(self, device: str) -> None:
        """The copies on `device` are updated in place (not refreshed)."""
        if device not in self.trained:
            self.trained.append(device)

    def leave(self) -> None:
        """Back to copies refreshed from the variables every step."""
        self.home, self.trained = None, []

    def home_copies(self) -> List[tf.Variable]:
        return self.on(self.home) if self.home else []

    def refresh(self) -> None:
        """Every copy but the home's := the current weights: the home's copies, else the
        variables (in a step: ordered before the calls that read them)."""
        source = self.home_copies() or self._values
        for device, copies in self._by_device.items():
            if device in self.trained:
                continue
            with tf.device(device), tf.name_scope("working_copies"):
                for copy, v in zip(copies, source):
                    copy.assign(v.read_value())

    def load_trained(self) -> None:
        """Every trained copy := its variable."""
        for device in self.trained:
            with tf.device(device), tf.name_scope("working_copies"):
                for copy, v in zip(self.on(device), self._values):
                    copy.assign(v.read_value())

    def store_home(self) -> None:
        """The variables := the home's copies."""
        for copy, v in zip(self.home_copies(), self._values):
            v.assign(copy.read_value())

    @contextlib.contextmanager
    def redirect(self, copies: Sequence[tf.Variable]):
        """While a call is traced, the layers' attributes holding the variables hold `copies`."""
        saved = [(layer, name, v) for v in self.variables if copies
                 for layer, name in self._slots[id(v)]]
        try:
            for (layer, name, v), copy in zip(saved, _per_slot(self, copies)):
                object.__setattr__(layer, name, copy)
            yield
        finally:
            for layer, name, v in saved:
                object.__setattr__(layer, name, v)


def _copy_of(variable, value: tf.Variable) -> tf.Variable:
    """A copy of model variable `variable`, whose tf.Variable is `value` (itself in Keras 2)."""
    # The variable's own name: an optimizer may choose by name (weight decay's exclusions).
    # Keras 3's variable names are a layer's own ("kernel"); their paths name the layer too.
    name = getattr(variable, "path", None) or value.name.rsplit(":", 1)[0]
    copy = tf.Variable(value.read_value(), trainable=True, name=name)
    if hasattr(variable, "true_dtype"):
        # Keras 2's mixed precision (AutoCastVariable): the copy is read in the layer's
        # compute dtype as the variable is, and kept in float32 as it is
        copy = type(variable)(copy)
    return copy


def _lives_on(variable: tf.Variable, device: str) -> bool:
    """Whether `device` (possibly partial, as `/device:CPU:1`) names the variable's device."""
    where = tf.DeviceSpec.from_string(variable.device)
    return where.make_merged_spec(tf.DeviceSpec.from_string(device)) == where


def _per_slot(copies: WorkingCopies, chosen: Sequence[tf.Variable]) -> List[tf.Variable]:
    return [c for v, c in zip(copies.variables, chosen) for _ in copies._slots[id(v)]]
