"""Print a benchmark's table: markdown (`--markdown`) or columns aligned for a terminal."""
from __future__ import annotations

from typing import Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for row in [list(header)] + [list(r) for r in rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
