"""Test-wide settings. Environment first: TensorFlow reads these when it initializes.

Threads are limited so multi-device tests behave on a 2-core machine, and 8 logical CPU devices
are configured by `import dapple` for the multi-device tests. `TF_USE_LEGACY_KERAS=1` where
tf_keras is installed is the Keras 2 suite's opt-in (its models say `tf.keras`; Keras 3 tests
say `import keras`): `import dapple` sets no variable (#30), and tests/dapple/test_keras2.py
checks that, and TensorFlow imported first, in fresh processes without it.
"""
import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DAPPLE_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "4")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
if importlib.util.find_spec("tf_keras") is not None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
