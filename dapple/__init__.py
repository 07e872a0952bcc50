"""dapple: synchronous pipeline + data parallel training of Keras models (after DAPPLE).

What users touch:

    import dapple                      # first: configures local logical devices
    pm = dapple.PipelinedModel(keras_model, "plan.json")
    pm.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    pm.fit(x, y, batch_size=plan_global_batch, epochs=2)

`import dapple` first makes `tf.keras` the Keras 2 API (it sets `TF_USE_LEGACY_KERAS=1`
before TensorFlow loads, and fails with what to do if TensorFlow was imported first; see
`dapple.keras2`), then splits the CPU into logical devices (TensorFlow fixes its device list at
first use, so this must happen before anything else touches TensorFlow; see `dapple.devices`),
and on Python 3.12 works around tf_keras's `set_random_seed` bug (`dapple.seed_workaround`).
The `dapple` command's subcommands that need no TensorFlow (`plan`, `simulate`, `emulate`) skip
all but the first so they start fast and work without TensorFlow installed.
"""
import importlib.util as _importlib_util
import os as _os
import sys as _sys

from dapple import keras2 as _keras2   # imports no TensorFlow

__version__ = "0.1.0"


def _invocation_without_tensorflow() -> bool:
    """The `dapple` command, or `python -m dapple.cli` (argv[0] is "-m" while runpy imports
    this package), running a command that needs no TensorFlow, or printing help."""
    from dapple.cli import needs_tensorflow
    return (_os.path.basename(_sys.argv[0] if _sys.argv else "") in ("dapple", "-m")
            and not needs_tensorflow(_sys.argv[1:]))


_HAS_TF = _importlib_util.find_spec("tensorflow") is not None
if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "dapple":
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # the CLI's own output stays readable
_keras2.select_before_tensorflow()
if _HAS_TF and not _invocation_without_tensorflow():
    from dapple.tf_cluster.cluster import connect_from_environment as _connect
    if not _connect():      # under `dapple launch --runtime=tensorflow`: before any model
        from dapple.devices import configure_local_devices as _configure_local_devices
        _configure_local_devices()
    _keras2.check_tf_keras()
    from dapple import seed_workaround as _seed_workaround
    _seed_workaround.install()

_LAZY = {
    "PipelinedModel": "dapple.pipelined_model",
    "profile": "dapple.profiler",
}


def __getattr__(name):
    if name in _LAZY:
        if not _HAS_TF:
            raise ImportError(f"dapple.{name} needs TensorFlow: pip install 'dapple[tf]'")
        module = __import__(_LAZY[name], fromlist=[name])
        return getattr(module, name)
    raise AttributeError(f"module 'dapple' has no attribute {name!r}")
