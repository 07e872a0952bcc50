"""Checkpoints of the plain model, written so that a failure never leaves a partial one."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import tensorflow as tf

from graph_rewrite.keras_adapter import is_keras3
from planner.formats.files import write_atomically


@contextlib.contextmanager
def _directory_beside(path: str, prefix: str):
    """A temporary directory on `path`'s filesystem (so renames out of it are atomic), removed
    afterwards whatever happens."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmpdir = tempfile.mkdtemp(dir=parent, prefix=prefix)
    try:
        yield parent, tmpdir
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def save_weights_atomically(model: tf.keras.Model, path: str) -> None:
    """`model.save_weights(path)` with no partial result visible at `path` if it fails.

    Keras 3: `.weights.h5` only, one file written beside and renamed into place.
    HDF5 (`.h5`/`.keras` suffix): one file, written beside and renamed into place. TensorFlow
    format (any other path): the files are written in a temporary directory beside the target
    and renamed into place with the `.index` file last, since TensorFlow reads a checkpoint
    through its index.
    """
    path = os.fspath(path)
    if is_keras3(model):
        if not path.endswith(".weights.h5"):
            raise ValueError(f"Keras 3 saves weights to a path ending .weights.h5 (its one "
                             f"weights format), got {path!r}")
        write_atomically(path, model.save_weights)      # the temporary file keeps the name
        return
    if path.endswith((".h5", ".keras", ".hdf5")):
        def write(tmp):
            # Keras 2 refuses HDF5 weights at a name ending .keras: write as .h5, then rename
            named = tmp + ".h5" if tmp.endswith(".keras") else tmp
            model.save_weights(named, save_format="h5")
            os.replace(named, tmp)
        write_atomically(path, write)
        return
    with _directory_beside(path, ".dapple-ckpt-") as (parent, tmpdir):
        base = os.path.basename(path)
        model.save_weights(os.path.join(tmpdir, base), save_format="tf")
        names = sorted(os.listdir(tmpdir), key=lambda n: (n.endswith(".index"), n == "checkpoint"))
        for name in names:
            if name == "checkpoint":
                continue    # TF's "latest checkpoint" bookkeeping; rewritten below for `parent`
            os.replace(os.path.join(tmpdir, name), os.path.join(parent, name))
        with open(os.path.join(tmpdir, "checkpoint"), "w") as f:
            f.write(f'model_checkpoint_path: "{base}"\nall_model_checkpoint_paths: "{base}"\n')
        os.replace(os.path.join(tmpdir, "checkpoint"), os.path.join(parent, "checkpoint"))


def save_model_atomically(model: tf.keras.Model, path: str, save_format=None) -> None:
    """`model.save(path)` (architecture, weights, optimizer) with no partial result at `path`.

    Keras 3: `.keras` only, one file written beside and renamed into place.
    One file (`.h5`, `.keras`): written beside and renamed into place. A SavedModel directory:
    written beside, then swapped in by two renames (the old one is removed after)."""
    path = os.fspath(path)
    if is_keras3(model):
        if not path.endswith(".keras"):
            raise ValueError(f"Keras 3 saves a whole model to a path ending .keras (its one "
                             f"format), got {path!r}")
        write_atomically(path, model.save)      # the temporary file keeps the name
        return
    if path.endswith((".h5", ".hdf5", ".keras")):
        fmt = save_format or ("h5" if path.endswith((".h5", ".hdf5")) else None)
        write_atomically(path, lambda tmp: model.save(tmp, save_format=fmt))
        return
    with _directory_beside(path, ".dapple-model-") as (_, tmpdir):
        new = os.path.join(tmpdir, "new")
        model.save(new, save_format=save_format or "tf")
        old = os.path.join(tmpdir, "old")
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(new, path)
