"""Reading `perf record -g` samples into classes of where the CPU went, for
`benchmarks/tf_runtime_cpu.py`: every sample goes in one class by its function and callers
(matrix products, transfers, a named op kernel, python, the OS kernel, the runtime)."""
from __future__ import annotations

import os
import re
import subprocess

TRANSFER = re.compile(r"grpc|Rendezvous|RecvTensor|SendOp|RecvOp|horovod|Horovod|gloo|"
                      r"CollectiveRemote|tcp_|sock_|inet_")
MATMUL = re.compile(r"dnnl|gemm|MatMul|Contraction|TensorContraction")
OP_KERNEL = re.compile(r"tensorflow::(\w+Op)\b(.*)::Compute(?:Async)?$")
FUNCTOR = re.compile(r"functor::(\w+)<")
JIT = re.compile(r"^\[JIT\]|/perf-\d+\.map$")    # oneDNN's generated kernels
NOT_AN_OP = ("PartitionedCallOp", "StatefulPartitionedCallOp")


def descendants(root: int) -> set:
    """`root` and every process under it, now."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, grew = {root}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def samples(data: str):
    """(pid, frames, leaf dso) of each sample in perf's recording `data`."""
    return parse_samples(subprocess.run(["perf", "script", "-i", data, "-F", "pid,ip,sym,dso"],
                                        capture_output=True, text=True, check=True).stdout)


def parse_samples(text: str):
    """(pid, frames, leaf dso) of each sample `perf script -F pid,ip,sym,dso` printed: a line
    with the pid, then a frame a line ('address symbol (dso)'), leaf first."""
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or not lines[0].split()[0].isdigit():
            continue
        frames = lines[1:]
        leaf = frames[0] if frames else ""
        dso = leaf.rsplit("(", 1)[-1].rstrip(")") if "(" in leaf else ""
        yield int(lines[0].split()[0]), frames, dso


def classify(frames, dso: str) -> str:
    """A sample's class (see the module doc) from its frames, leaf first."""
    leaf = frames[0] if frames else ""
    if JIT.search(dso) or MATMUL.search(leaf):
        return "matmul"
    chain = "\n".join(frames)
    if TRANSFER.search(chain):
        return "transfer"
    if MATMUL.search(chain):
        return "matmul"
    for frame in frames:
        symbol = frame.split(" ", 1)[-1].rsplit(" (", 1)[0]
        m = OP_KERNEL.search(symbol)
        if m and m.group(1) not in NOT_AN_OP:
            functor = FUNCTOR.search(m.group(2))
            return "op " + m.group(1) + (f"<{functor.group(1)}>" if functor else "")
    if "libpython" in dso:
        return "python"
    if "kernel" in dso:
        return "OS kernel"
    return "runtime"
