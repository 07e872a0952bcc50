"""Test-wide settings. Environment first: TensorFlow reads these when it initializes.

Threads are limited so multi-device tests behave on a 2-core machine, and 8 logical CPU devices
are configured by `import dapple` for the multi-device tests.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DAPPLE_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "4")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
