"""benchmarks/gpu_first_run.sh on a machine without GPUs (CUDA hidden, as in every test here):
it profiles and plans a small model on the CPU, skips the GPU listing and the timed runs, says
so, and still writes the summary table."""
import json
import os
import subprocess
import sys

from planner.formats.plan import Plan
from tests.paths import REPO as ROOT


def test_gpu_first_run_on_a_cpu_machine_skips_what_needs_gpus_and_says_so(tmp_path):
    out = tmp_path / "first_run"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable,
               NVIDIA_SMI=str(tmp_path / "no-nvidia-smi"))   # whatever this machine has
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_first_run.sh"),
                           str(out)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    headings = [line for line in text.splitlines() if line.startswith("== ")]
    assert [h.split()[1] for h in headings] == ["1.", "2.", "3.", "4.", "5.", "summary"], headings
    assert "TensorFlow sees 0 GPU(s)" in text
    skipped = [line.strip() for line in text.split("skipped on this machine:")[1].splitlines()
               if line.strip()]
    assert skipped == [
        "- listing GPUs and links: nvidia-smi is missing or finds no GPU on this machine",
        "- pipelined against plain data-parallel step time: needs 2 or more GPUs, found 0",
        "- predicted against measured step time: no pipelined run on GPUs"], skipped

    with open(out / "profile.json") as f:
        profile = json.load(f)
    plan = Plan.load(str(out / "plan.json"))
    assert plan.global_batch_size == 16
    assert plan.stages[-1].last == len(profile["layers"]) - 1 >= 10   # the whole small encoder
    assert "Strategy for bert_2x64 on 1x2" in text
    table = (out / "first_run.md").read_text().splitlines()
    assert len(table) == 3 and table[0].startswith("| host | model |"), table
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[2] == "16" and cells[3].startswith(plan.shape()) and cells[4:] == ["-"] * 5, cells
