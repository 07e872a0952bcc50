"""`import dapple`'s effects (docs/runtime.md, "What `import dapple` does") happen by default,
not at all under `DAPPLE_CONFIGURE_ON_IMPORT=0`, and on `dapple.configure()`. Each case runs
in a fresh interpreter (TensorFlow's device list is fixed at first use); TensorFlow's own device
list and the process environment are the reference."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The seed workaround is installed once tf_keras is imported (here after dapple), and `import
# dapple` sets no TF_USE_LEGACY_KERAS (#30: no import-order rule, tf.keras left as it is).
REPORT = ("import os, tensorflow as tf, tf_keras, dapple.seed_workaround as sw\n"
          "print(len(tf.config.list_logical_devices('CPU')), os.environ.get('TF_USE_LEGACY_KERAS'),"
          " sw.installed() or not sw.needed())\n")


def _run(code, **env):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TF_USE_LEGACY_KERAS", "DAPPLE_CONFIGURE_ON_IMPORT")}
    environment.update(DAPPLE_NUM_CPU_DEVICES="3", PYTHONPATH=ROOT, **env)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()


def test_import_sets_up_devices_and_the_seed_workaround():
    assert _run("import dapple\n" + REPORT) == ["3", "None", "True"]


def test_the_opt_out_leaves_the_process_alone():
    got = _run("import dapple\n" + REPORT, DAPPLE_CONFIGURE_ON_IMPORT="0")
    assert got == ["1", "None", str(sys.version_info < (3, 12))]


def test_configure_does_what_the_import_skipped():
    assert _run("import dapple\ndapple.configure()\n" + REPORT,
                DAPPLE_CONFIGURE_ON_IMPORT="0") == ["3", "None", "True"]
