"""Per-layer profiles: what the planner knows about a model, and the native JSON format.

A profile lists the model's layers in topological order (the positions a Plan's `layers:
[first, last]` refer to) with forward/backward times, output and parameter bytes, and the
positions each layer reads from. Files: the native JSON (`"format": "dapple-profile"`, written by
the Keras profiler, read by `parse_native_json`) and the published PipeDream/DAPPLE `graph.txt`
(`planner.formats.profile_readers`, which also detects the format: `load_profile`).

The activation bytes of a cut after position p count every tensor produced at positions <= p
(or a model input) and consumed at a position > p, once per producer, however many consumers
it has past the cut. This matters for DAGs (GNMT, ResNet, AmoebaNet's two-cell skip inputs).

Times and output bytes are for the profile's batch and scale linearly with the batch
(`Profile.scaled`); parameter bytes do not. How devices lose efficiency at small batches is the
cost model's business, not the profile's.

Shared parameters (native format, optional `"shared_parameters": [{"bytes": B, "positions":
[p1, p2, ...]}, ...]`): variables used at several layer positions (a layer called in several
places, a tied embedding and output projection). A layer's `parameter_bytes` holds only the
variables used at its position alone; each shared entry is held by every stage whose layer range
contains one of its positions, once per stage (`Profile.parameter_bytes`), so a stage's memory
and its replicas' allreduce count it. Not modelled: the extra allreduce that keeps the copies
of a variable held by several stages identical (the cost model ignores it), and the compute of
a shared layer's later calls where they run: all its calls' time is counted at the position of
its first call (the profiler counts their outputs where they are produced).

Compute dtype (native format, optional `"compute_dtype"`, default float32): the dtype of the
activations (Keras's mixed-precision policy). `Profile.with_compute_dtype` rescales a profile
to another: every layer's output bytes (and so the cut bytes) by new size / old size; the model
inputs' bytes are kept (Keras does not cast model inputs), and so are parameter bytes (weights
stay float32 under mixed precision). graph.txt profiles are float32.
"""
from __future__ import annotations

import hashlib
import json
import os
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

from planner.formats.files import write_text_atomically

# Bytes per element of the activation dtypes a profile may record.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


class ProfileError(ValueError):
    """A profile that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Layer:
    name: str
    type: str
    forward_ms: float
    backward_ms: float
    output_bytes: float
    parameter_bytes: float
    inputs: tuple = ()          # positions of producer layers; -1 = a model input
    # The part of backward_ms that is the input gradient (I of a split backward); None when
    # not measured (graph.txt profiles): half of it is assumed.
    input_gradient_ms: Optional[float] = None


@dataclass(frozen=True)
class SharedParameters:
    """Variables used at several layer positions: held once by every stage containing one."""
    bytes: float
    positions: Tuple[int, ...]  # sorted, distinct


@dataclass
class Profile:
    name: str
    batch_size: float
    layers: List[Layer]
    input_bytes: float = 0.0
    model_signature: Optional[str] = None
    device: str = ""
    source: str = ""
    shared_parameters: Tuple[SharedParameters, ...] = ()
    compute_dtype: str = "float32"
    # derived
    cut_bytes: List[float] = field(default_factory=list, repr=False)   # length N-1
    content_hash: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"{self.source or self.name}: the profile has no layers")
        if not self.batch_size > 0:
            raise ProfileError(f"{self.source or self.name}: batch size must be positive, got "
                               f"{self.batch_size}")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ProfileError(f"{self.source or self.name}: compute dtype "
                               f"{self.compute_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        self.shared_parameters = tuple(self.shared_parameters)
        for e in self.shared_parameters:
            if not e.positions or list(e.positions) != sorted(set(e.positions)) or \
                    not 0 <= e.positions[0] <= e.positions[-1] < len(self.layers):
                raise ProfileError(f"{self.source or self.name}: shared parameter positions "
                                   f"{list(e.positions)} must be distinct, sorted layer positions "
                                   f"0..{len(self.layers) - 1}")
        self.cut_bytes = _cut_bytes(self.layers, self.input_bytes)
        self._forward_prefix = [0.0] + list(accumulate(l.forward_ms for l in self.layers))
        self._backward_prefix = [0.0] + list(accumulate(l.backward_ms for l in self.layers))
        self._param_prefix = [0.0] + list(accumulate(l.parameter_bytes for l in self.layers))
        self._output_prefix = [0.0] + list(accumulate(l.output_bytes for l in self.layers))
        if not self.content_hash:
            self.content_hash = self._hash()

    # ---- views ----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> List[str]:
        return [l.name for l in self.layers]

    def forward_ms(self, first: int, last: int) -> float:
        """Forward time of layers first..last (inclusive) at the profile batch."""
        return self._forward_prefix[last + 1] - self._forward_prefix[first]

    def backward_ms(self, first: int, last: int) -> float:
        return self._backward_prefix[last + 1] - self._backward_prefix[first]

    def input_gradient_fraction(self, first: int, last: int) -> float:
        """The share of layers first..last's backward that is the input gradient (I): measured
        where the profile has it, half of each other layer's backward."""
        backward = self.backward_ms(first, last)
        if backward <= 0:
            return 0.5
        return sum(l.backward_ms / 2 if l.input_gradient_ms is None else l.input_gradient_ms
                   for l in self.layers[first:last + 1]) / backward

    def parameter_bytes(self, first: int, last: int) -> float:
        """Parameters a stage of layers first..last holds: its layers' own, plus each shared
        entry with a position in the range, once. O(shared entries)."""
        total = self._param_prefix[last + 1] - self._param_prefix[first]
        for e in self.shared_parameters:
            i = bisect_left(e.positions, first)
            if i < len(e.positions) and e.positions[i] <= last:
                total += e.bytes
        return total

    def output_bytes(self, first: int, last: int) -> float:
        """Sum of layer outputs of first..last at the profile batch (activation memory proxy)."""
        return self._output_prefix[last + 1] - self._output_prefix[first]

    def boundary_bytes(self, last: int) -> float:
        """Bytes crossing the cut after layer `last` at the profile batch."""
        return self.cut_bytes[last]

    @property
    def total_parameter_bytes(self) -> float:
        """The model's parameters, each variable once."""
        return self._param_prefix[-1] + sum(e.bytes for e in self.shared_parameters)

    def scaled(self, batch_size: float) -> "Profile":
        """The same model at another batch: times and activations linear, parameters fixed."""
        if not batch_size > 0:
            raise ProfileError(f"cannot scale a profile to batch {batch_size}")
        r = batch_size / self.batch_size
        layers = [Layer(l.name, l.type, l.forward_ms * r, l.backward_ms * r, l.output_bytes * r,
                        l.parameter_bytes, l.inputs,
                        None if l.input_gradient_ms is None else l.input_gradient_ms * r)
                  for l in self.layers]
        return Profile(name=self.name, batch_size=batch_size, layers=layers,
                       input_bytes=self.input_bytes * r, model_signature=self.model_signature,
                       device=self.device, source=self.source,
                       shared_parameters=self.shared_parameters,
                       compute_dtype=self.compute_dtype, content_hash=self.content_hash)

    def with_compute_dtype(self, dtype: str) -> "Profile":
        """The same model with activations in `dtype`: layer output bytes times
        size(dtype) / size(self.compute_dtype); model inputs, parameters and times unchanged.
        A new content hash (plans made for one dtype do not evaluate against the other)."""
        if dtype not in DTYPE_BYTES:
            raise ProfileError(f"unknown compute dtype {dtype!r}; expected one of "
                               f"{', '.join(DTYPE_BYTES)}")
        if dtype == self.compute_dtype:
            return self
        r = DTYPE_BYTES[dtype] / DTYPE_BYTES[self.compute_dtype]
        layers = [Layer(l.name, l.type, l.forward_ms, l.backward_ms, l.output_bytes * r,
                        l.parameter_bytes, l.inputs, l.input_gradient_ms) for l in self.layers]
        return Profile(name=self.name, batch_size=self.batch_size, layers=layers,
                       input_bytes=self.input_bytes, model_signature=self.model_signature,
                       device=self.device, source=self.source,
                       shared_parameters=self.shared_parameters, compute_dtype=dtype)

    def summary(self) -> Dict[str, object]:
        d = {"name": self.name, "hash": self.content_hash,
             "model_signature": self.model_signature}
        if self.compute_dtype != "float32":
            d["compute_dtype"] = self.compute_dtype
        return d

    def to_dict(self) -> Dict[str, object]:
        """The native JSON format."""
        d = {"format": "dapple-profile", "version": 1, "name": self.name,
             "batch_size": self.batch_size, "device": self.device,
             "input_bytes": self.input_bytes,
             "layers": [{"name": l.name, "type": l.type, "forward_ms": l.forward_ms,
                         "backward_ms": l.backward_ms, "output_bytes": l.output_bytes,
                         "parameter_bytes": l.parameter_bytes, "inputs": list(l.inputs)}
                        for l in self.layers]}
        for entry, l in zip(d["layers"], self.layers):
            if l.input_gradient_ms is not None:
                entry["input_gradient_ms"] = l.input_gradient_ms
        if self.model_signature:
            d["model_signature"] = self.model_signature
        d["compute_dtype"] = self.compute_dtype
        if self.shared_parameters:
            d["shared_parameters"] = [{"bytes": e.bytes, "positions": list(e.positions)}
                                      for e in self.shared_parameters]
        return d

    def save(self, path: str) -> None:
        """Write the native JSON format, atomically."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def _hash(self) -> str:
        """sha256 of the profile's content (not its file bytes), so the same measurements in
        graph.txt or JSON form, or re-indented, hash the same. Shared parameters and a
        compute dtype other than float32 are hashed only when present (older profiles keep
        their hash)."""
        canon = [float(self.batch_size), float(self.input_bytes),
                 [[l.name, round(l.forward_ms, 9), round(l.backward_ms, 9),
                   round(l.output_bytes, 3), round(l.parameter_bytes, 3), list(l.inputs)]
                  for l in self.layers]]
        if self.shared_parameters:
            canon.append([[round(e.bytes, 3), list(e.positions)]
                          for e in self.shared_parameters])
        if self.compute_dtype != "float32":
            canon.append(self.compute_dtype)
        if any(l.input_gradient_ms is not None for l in self.layers):
            canon.append([None if l.input_gradient_ms is None else round(l.input_gradient_ms, 9)
                          for l in self.layers])
        return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()


def _cut_bytes(layers: Sequence[Layer], input_bytes: float) -> List[float]:
    """cut[p] = bytes of every tensor produced at <= p (or a model input) consumed at > p."""
    n = len(layers)
    last_use = {}                      # producer position (-1: model inputs) -> last consumer
    for pos, layer in enumerate(layers):
        for src in layer.inputs:
            if src >= pos:
                raise ProfileError(f"layer {pos} ({layer.name}) consumes layer {src}, which is "
                                   f"not before it: layers must be in topological order")
            last_use[src] = max(last_use.get(src, -1), pos)
    # Difference array: producer u contributes its bytes to cuts u .. last_use[u]-1.
    delta = [0.0] * (n + 1)
    for src, last in last_use.items():
        size = input_bytes if src < 0 else layers[src].output_bytes
        start = max(src, 0)
        if last > start:
            delta[start] += size
            delta[last] -= size
    out, running = [], 0.0
    for p in range(n - 1):
        running += delta[p]
        out.append(running)
    return out


# ---- the native format ---------------------------------------------------------------

def default_name(path: str) -> str:
    """The profile's name from its file name (a PipeDream graph.txt: its directory's)."""
    base = os.path.basename(path)
    for suffix in (".txt", ".json"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if base == "graph":     # PipeDream layout: <model>/graph.txt
        base = os.path.basename(os.path.dirname(os.path.abspath(path))) or base
    return base


def number_field(text: str, where: str, key: str) -> float:
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise ProfileError(f"{where}: {key}={text} has an unclosed '['")
        items = [t for t in text[1:-1].split(";") if t.strip()]
        if not items:
            raise ProfileError(f"{where}: {key}=[] lists no values")
        return sum(number_field(t, where, key) for t in items)
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{where}: {key}={text!r} is not a number") from None
    if value != value or value < 0 or value == float("inf"):
        raise ProfileError(f"{where}: {key}={text!r} must be a finite number >= 0")
    return value


def parse_native_json(text: str, path: str = "<string>", batch_size: Optional[float] = None,
                      name: Optional[str] = None) -> Profile:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); the file may be "
                           f"truncated") from None
    if not isinstance(d, dict) or d.get("format") != "dapple-profile":
        raise ProfileError(f"{path}: a native profile is a JSON object with \"format\": "
                           f"\"dapple-profile\"")
    if d.get("version") != 1:
        raise ProfileError(f"{path}: profile version {d.get('version')!r} is not supported "
                           f"(this dapple reads version 1)")
    for key in ("batch_size", "layers"):
        if key not in d:
            raise ProfileError(f"{path}: the profile has no {key!r} field")
    if not isinstance(d["layers"], list) or not d["layers"]:
        raise ProfileError(f"{path}: 'layers' must be a non-empty list")
    layers = []
    for i, l in enumerate(d["layers"]):
        where = f"{path}: layers[{i}]"
        if not isinstance(l, dict):
            raise ProfileError(f"{where} is not an object")
        try:
            vals = {k: number_field(str(l[k]), where, k) for k in
                    ("forward_ms", "backward_ms", "output_bytes", "parameter_bytes")}
        except KeyError as e:
            raise ProfileError(f"{where} ({l.get('name', '?')}) has no {e.args[0]!r}") from None
        inputs = l.get("inputs", [i - 1] if i else [-1])
        if not isinstance(inputs, list) or not all(isinstance(x, int) for x in inputs):
            raise ProfileError(f"{where}: 'inputs' must be a list of layer positions")
        for x in inputs:
            if not -1 <= x < i:
                raise ProfileError(f"{where} ({l.get('name', '?')}): input {x} is not an earlier "
                                   f"layer position or -1 (a model input)")
        if "input_gradient_ms" in l:
            vals["input_gradient_ms"] = number_field(str(l["input_gradient_ms"]), where,
                                                     "input_gradient_ms")
            if not 0 <= vals["input_gradient_ms"] <= vals["backward_ms"]:
                raise ProfileError(f"{where} ({l.get('name', '?')}): input_gradient_ms "
                                   f"{vals['input_gradient_ms']} must be between 0 and "
                                   f"backward_ms ({vals['backward_ms']})")
        layers.append(Layer(name=str(l.get("name", f"layer{i}")), type=str(l.get("type", "")),
                            inputs=tuple(inputs), **vals))
    shared = d.get("shared_parameters", [])
    if not isinstance(shared, list):
        raise ProfileError(f"{path}: 'shared_parameters' must be a list")
    entries = []
    for i, e in enumerate(shared):
        where = f"{path}: shared_parameters[{i}]"
        if not isinstance(e, dict) or "bytes" not in e or "positions" not in e:
            raise ProfileError(f"{where} must be an object with 'bytes' and 'positions'")
        positions = e["positions"]
        if not isinstance(positions, list) or not positions or \
                not all(isinstance(x, int) and 0 <= x < len(layers) for x in positions):
            raise ProfileError(f"{where}: 'positions' must be a non-empty list of layer "
                               f"positions 0..{len(layers) - 1}")
        entries.append(SharedParameters(number_field(str(e["bytes"]), where, "bytes"),
                                        tuple(sorted(set(positions)))))
    compute_dtype = d.get("compute_dtype", "float32")
    if compute_dtype not in DTYPE_BYTES:
        raise ProfileError(f"{path}: compute_dtype {compute_dtype!r} is not one of "
                           f"{', '.join(DTYPE_BYTES)}")
    return Profile(name=name or str(d.get("name") or default_name(path)),
                   batch_size=batch_size if batch_size is not None else
                   number_field(str(d["batch_size"]), path, "batch_size"),
                   layers=layers, input_bytes=number_field(str(d.get("input_bytes", 0)), path,
                                                      "input_bytes"),
                   model_signature=d.get("model_signature"), device=str(d.get("device", "")),
                   source=path, shared_parameters=tuple(entries), compute_dtype=compute_dtype)
