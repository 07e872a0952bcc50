"""Parsing and printing sizes ("16GB", "512MiB") and rates ("25Gbps", "130GB/s")."""
from __future__ import annotations

import re

from topology.errors import TopologyError

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
# Device memory is sold in binary units: "16GB" on a V100 means 16 GiB.
_MEMORY_UNITS = dict(_SIZE_UNITS, kb=2 ** 10, mb=2 ** 20, gb=2 ** 30, tb=2 ** 40)
# Rates are case-sensitive, as in SI: b is a bit and B a byte; k (or K), M, G, T scale by 1e3.
_RATE_PREFIXES = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE_UNIT = re.compile(r"^(?P<prefix>[kKMGT]?)(?P<unit>b|bit|bits|B|byte|bytes)(?:ps|/s)$")
_RATE_SPELLINGS = ("Gbps, Gb/s, Gbit/s (bits per second); GBps, GB/s (bytes per second); "
                   "prefixes k, M, G, T")
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")


def _split(text: str, what: str, example: str, lower: bool = True):
    m = _NUMBER.match(str(text))
    if not m:
        raise TopologyError(f"cannot read {what} {text!r}; write a number and a unit, e.g. "
                            f"{example}")
    return float(m.group(1)), m.group(2).lower() if lower else m.group(2)


def parse_memory(text: str) -> float:
    """Bytes of device memory; GB/MB are binary here (16GB = 16 GiB), as memory is sold."""
    value, unit = _split(text, "a memory size", "16GB")
    if unit not in _MEMORY_UNITS:
        raise TopologyError(f"unknown memory unit {unit!r} in {text!r}; use B, KB, MB, GB, TB "
                            f"(or KiB, MiB, GiB, TiB)")
    if value <= 0:
        raise TopologyError(f"memory size must be positive, got {text!r}")
    return value * _MEMORY_UNITS[unit]


def parse_bandwidth(text: str) -> float:
    """Bytes per second from '25Gbps', '25Gb/s' (bits) or '130GB/s', '130GBps' (bytes)."""
    value, unit = _split(text, "a bandwidth", "25Gbps or 130GB/s", lower=False)
    m = _RATE_UNIT.match(unit)
    if m is None:
        # 'mbps', 'GBPS', 'Gbit': which scale, or bits or bytes, is a guess (8x apart): refuse.
        raise TopologyError(f"unknown bandwidth unit {unit!r} in {text!r}: b is a bit and B a "
                            f"byte, case matters; write one of {_RATE_SPELLINGS}")
    if value <= 0:
        raise TopologyError(f"bandwidth must be positive, got {text!r}: a link of zero "
                            f"bandwidth can never move data")
    per_unit = 1 / 8 if m.group("unit") in ("b", "bit", "bits") else 1
    return value * _RATE_PREFIXES[m.group("prefix")] * per_unit


def parse_latency(text: str) -> float:
    """Seconds from '50us', '0.1ms', '1e-5s'."""
    value, unit = _split(text, "a latency", "50us")
    scale = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}.get(unit)
    if scale is None:
        raise TopologyError(f"unknown latency unit {unit!r} in {text!r}; use s, ms, us or ns")
    return value * scale


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_bandwidth(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.3g} GB/s"
    return f"{bps / 1e6:.3g} MB/s"
