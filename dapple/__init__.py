"""dapple: synchronous pipeline + data parallel training of Keras models (after DAPPLE).

What users touch:

    import dapple                      # first: configures local logical devices
    pm = dapple.PipelinedModel(keras_model, "plan.json")
    pm.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    pm.fit(x, y, batch_size=plan_global_batch, epochs=2)

`import dapple` sets up the process for dapple (docs/runtime.md, "What `import dapple` does",
lists every effect): it splits the CPU into logical devices (or connects to a TensorFlow
cluster) and works around a tf_keras seeding bug on Python 3.12. It may come before or after
`import tensorflow`, and leaves `tf.keras` as TensorFlow makes it (Keras 3 on TensorFlow 2.16+;
tf_keras with TF_USE_LEGACY_KERAS=1): dapple takes Keras 3 and tf_keras models (docs/keras3.md).
Set `DAPPLE_CONFIGURE_ON_IMPORT=0` to skip all of it, and call `dapple.configure()` when you
want it.
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
ENV_CONFIGURE_ON_IMPORT = "DAPPLE_CONFIGURE_ON_IMPORT"   # "0": `import dapple` changes nothing


def configure(tensorflow: bool = True) -> None:
    """What `import dapple` does unless `DAPPLE_CONFIGURE_ON_IMPORT=0` (docs/runtime.md, "What
    `import dapple` does"); call it once, before anything else touches TensorFlow.
    `tensorflow=False`: only what needs no TensorFlow (the `dapple` command's planner
    subcommands start fast and work without TensorFlow installed)."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "dapple":
        _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # the CLI's output stays readable
    _cli_selects_keras2()
    if _HAS_TF and tensorflow:
        from dapple.runtime.tf_cluster.cluster import connect_from_environment
        if not connect_from_environment():   # under `dapple launch --runtime=tensorflow`
            from dapple.devices import configure_local_devices
            configure_local_devices()
    from dapple import seed_workaround       # imports no TensorFlow, no tf_keras
    seed_workaround.install_when_imported()


# The `dapple` command's commands that build a user's model in this process (`--model=m:f`),
# whose builders say `tf.keras`: Keras 2 there, as before #30, until their Keras 3
# path is tested (docs/keras3.md). Not `launch`: its children are the user's own scripts.
CLI_KERAS2_COMMANDS = ("verify", "profile")


def _cli_selects_keras2() -> None:
    """The `dapple` command (not `import dapple`) running a CLI_KERAS2_COMMANDS command makes
    `tf.keras` tf_keras for its own process when tf_keras is installed and TensorFlow not yet
    loaded, unless TF_USE_LEGACY_KERAS is set already."""
    if (_os.path.basename(_sys.argv[0] if _sys.argv else "") in ("dapple", "-m")
            and len(_sys.argv) > 1 and _sys.argv[1] in CLI_KERAS2_COMMANDS
            and "tensorflow" not in _sys.modules
            and _importlib_util.find_spec("tf_keras") is not None):
        _os.environ.setdefault(_keras2.ENV, "1")


if _os.environ.get(ENV_CONFIGURE_ON_IMPORT, "1") != "0":
    configure(tensorflow=not _invocation_without_tensorflow())

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
