"""Reading profile files: the PipeDream/DAPPLE `graph.txt` format, and detecting it from the
native JSON (`planner.formats.profile`).

graph.txt: node lines `nodeN -- <description> -- key=value, ...` and edge lines (indented)
`nodeA -- nodeB`. Nodes may come in any order and form a DAG. Descriptions may contain ` -- `;
the key=value part is found from `forward_compute_time=`. A multi-output node
(`activation_size=[a; b]`) outputs a + b bytes. The profile batch size is taken from a
`-pbs-N` in the file name unless given. Layers are put in a topological order (Kahn's
algorithm, ties broken by node number, the order the model was built in); those positions are
what a Plan's `layers: [first, last]` refer to.
"""
from __future__ import annotations

import heapq
import os
import re
from typing import Dict, List, Optional

from planner.formats.profile import (Layer, Profile, ProfileError, default_name, number_field,
                             parse_native_json)


def load_profile(path: str, batch_size: Optional[float] = None, name: Optional[str] = None
                 ) -> Profile:
    """Read a graph.txt or native JSON profile (detected by content).

    `batch_size` overrides the file's profile batch (graph.txt files without `-pbs-N` in their
    name need it). Raises ProfileError naming the file (and line) on malformed input.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProfileError(f"profile file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ProfileError(f"profile path {path!r} is a directory, not a file") from None
    if not text.strip():
        raise ProfileError(f"{path}: the profile file is empty")
    if text.lstrip().startswith("{"):
        return parse_native_json(text, path, batch_size=batch_size, name=name)
    return parse_graph_txt(text, path, batch_size=batch_size, name=name)


_PBS = re.compile(r"-pbs-(\d+)")
_NODE = re.compile(r"^(\S+) -- (.*) -- (forward_compute_time=.*)$")
_EDGE = re.compile(r"^[ \t]+(\S+)\s+--\s+(\S+)\s*$")
_REQUIRED = ("forward_compute_time", "backward_compute_time", "activation_size",
             "parameter_size")


def _parse_fields(rest: str, where: str) -> Dict[str, float]:
    # Strip trailing " -- stage_id=N" (and anything else after another " -- ").
    extra = {}
    parts = rest.split(" -- ")
    body = parts[0]
    for p in parts[1:]:
        if "=" in p:
            k, v = p.split("=", 1)
            extra[k.strip()] = v.strip()
    # Split on commas that are not inside brackets.
    fields, depth, cur = [], 0, ""
    for ch in body:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            fields.append(cur)
            cur = ""
        else:
            cur += ch
    fields.append(cur)
    values = {}
    for item in fields:
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ProfileError(f"{where}: expected key=value, found {item!r} (the line may be "
                               f"truncated or missing fields)")
        k, v = item.split("=", 1)
        values[k.strip()] = v.strip()
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ProfileError(f"{where}: node line is missing {', '.join(missing)} (the line may be "
                           f"truncated)")
    return {k: number_field(values[k], where, k) for k in _REQUIRED}


def parse_graph_txt(text: str, path: str = "<string>", batch_size: Optional[float] = None,
                    name: Optional[str] = None) -> Profile:
    nodes: Dict[str, dict] = {}
    order: List[str] = []
    edges: List[tuple] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        if line[0] in " \t":
            m = _EDGE.match(line)
            if not m:
                raise ProfileError(f"{where}: cannot read edge line {line.strip()!r}; expected "
                                   f"'nodeA -- nodeB' indented by whitespace")
            edges.append((m.group(1), m.group(2), lineno))
            continue
        m = _NODE.match(line.rstrip())
        if not m:
            if " -- " in line and "forward_compute_time" not in line:
                raise ProfileError(f"{where}: node line has no forward_compute_time=...; the "
                                   f"line may be truncated: {line[:80]!r}")
            raise ProfileError(f"{where}: cannot read {line[:80]!r}; expected 'nodeN -- "
                               f"description -- forward_compute_time=..., ...' or an indented "
                               f"edge 'nodeA -- nodeB'")
        node_id, desc, rest = m.group(1), m.group(2).strip(), m.group(3)
        if node_id in nodes:
            raise ProfileError(f"{where}: node {node_id} is defined twice (first on line "
                               f"{nodes[node_id]['line']})")
        values = _parse_fields(rest, where)
        nodes[node_id] = dict(desc=desc, line=lineno, **values)
        order.append(node_id)
    if not nodes:
        raise ProfileError(f"{path}: no node lines found; is this a PipeDream/DAPPLE graph.txt?")
    preds: Dict[str, List[str]] = {n: [] for n in nodes}
    succs: Dict[str, List[str]] = {n: [] for n in nodes}
    for a, b, lineno in edges:
        for x in (a, b):
            if x not in nodes:
                raise ProfileError(f"{path}:{lineno}: edge {a} -- {b} names {x}, which has no "
                                   f"node line (truncated file?)")
        if b not in succs[a]:
            succs[a].append(b)
            preds[b].append(a)

    def key(n: str):
        m = re.match(r"^node(\d+)$", n)
        return (0, int(m.group(1)), 0) if m else (1, 0, order.index(n))

    indeg = {n: len(preds[n]) for n in nodes}
    heap = [(key(n), n) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    topo: List[str] = []
    while heap:
        _, n = heapq.heappop(heap)
        topo.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (key(s), s))
    if len(topo) != len(nodes):
        stuck = sorted((n for n in nodes if indeg[n] > 0), key=key)[:5]
        raise ProfileError(f"{path}: the graph has a cycle through {', '.join(stuck)}; a profile "
                           f"must be a DAG")
    position = {n: i for i, n in enumerate(topo)}
    layers = []
    for n in topo:
        v = nodes[n]
        layers.append(Layer(name=f"{n}:{v['desc']}" if len(v["desc"]) <= 40 else
                            f"{n}:{v['desc'][:37]}...",
                            type=v["desc"].split("(")[0].strip() or "node",
                            forward_ms=v["forward_compute_time"],
                            backward_ms=v["backward_compute_time"],
                            output_bytes=v["activation_size"],
                            parameter_bytes=v["parameter_size"],
                            inputs=tuple(sorted(position[p] for p in preds[n]))))
    if batch_size is None:
        m = _PBS.search(os.path.basename(path))
        if not m:
            raise ProfileError(f"{path}: the profile batch size is unknown (graph.txt does not "
                               f"record it); name the file '...-pbs-N.txt' or pass it "
                               f"(load_profile(path, batch_size=N), dapple plan "
                               f"--profile_batch_size=N)")
        batch_size = int(m.group(1))
    return Profile(name=name or default_name(path), batch_size=batch_size, layers=layers,
                   source=path, device="graph.txt")


