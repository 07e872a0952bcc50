"""dapple: synchronous pipeline + data parallel training of Keras models (after DAPPLE).

What users touch:

    import dapple                      # first: configures local logical devices
    pm = dapple.PipelinedModel(keras_model, "plan.json")
    pm.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    pm.fit(x, y, batch_size=plan_global_batch, epochs=2)

`import dapple` splits the CPU into logical devices (TensorFlow fixes its device list at first
use, so this must happen before anything else touches TensorFlow; see `dapple.devices`). The
`dapple` command's subcommands that need no TensorFlow (`plan`, `simulate`, `emulate`) skip
this so they start fast and work without TensorFlow installed.
"""
import importlib.util as _importlib_util
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _invocation_without_tensorflow() -> bool:
    from dapple.cli import COMMANDS_WITHOUT_TENSORFLOW
    return (_os.path.basename(_sys.argv[0] if _sys.argv else "") == "dapple"
            and len(_sys.argv) > 1 and _sys.argv[1] in COMMANDS_WITHOUT_TENSORFLOW)


_HAS_TF = _importlib_util.find_spec("tensorflow") is not None
if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "dapple":
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # the CLI's own output stays readable
if _HAS_TF and not _invocation_without_tensorflow():
    from dapple.devices import configure_local_devices as _configure_local_devices
    _configure_local_devices()

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
