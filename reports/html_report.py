"""The strategy report with pictures (the DAPPLE paper's Fig. 12/13 and Table V/VII, for one
model), from rows that `reports.comparison` computed: for each global batch size

* the plan table: stages as `(first, last) @ [devices]` (Table VII's form), micro-batches,
  schedule, the formula's latency (eq. 1-3), the simulated iteration and the speedup;
* the timeline of the best plan (and the held-activation picture, if given);
* a bar chart of speedups, one group per global batch size, one bar per candidate.

A `.html` path gets one self-contained file (PNG pictures embedded as base64); a `.md` path gets
markdown with the PNGs written next to it.
"""
from __future__ import annotations

import base64
import html
import os
import textwrap
from typing import List, Optional, Sequence

from reports.comparison import ReportRow, speedups
from reports.text_report import RELAXED_CAPTION, markdown_table, relaxed_table, schedule_table
from reports.timeline import (figure_png, held_activations_figure, held_stages, require_matplotlib,
                              timeline_figure)

BAR_COLOURS = ["#2f5597", "#c55a11", "#7f7f7f", "#bf9000", "#548235", "#7030a0"]


def stage_notation(plan) -> str:
    """Table VII's form: `(0, 16) @ [0-13]; (17, 25) @ [14, 15]`."""
    parts = []
    for st in plan.stages:
        d = st.devices
        if len(d) > 2 and d == list(range(d[0], d[-1] + 1)):
            devices = f"{d[0]}-{d[-1]}"
        else:
            devices = ", ".join(str(x) for x in d)
        parts.append(f"({st.first}, {st.last}) @ [{devices}]")
    return "; ".join(parts)


def speedup_figure(rows: Sequence[ReportRow], baseline: Optional[str] = None,
                   title: Optional[str] = None):
    """Grouped bars: one group per global batch size, one bar per candidate (Fig. 12/13)."""
    Figure = require_matplotlib()
    from matplotlib.patches import Patch
    names: List[str] = []
    for row in rows:
        for c in row.candidates:
            if c.name not in names:
                names.append(c.name)
    fig = Figure(figsize=(max(6.0, 1.2 + 0.55 * len(names) * len(rows) + 0.6 * len(rows)), 4.2),
                 dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(len(names), 1)
    top = 0.0
    for g, row in enumerate(rows):
        values = speedups(row, baseline)
        for i, name in enumerate(names):
            x = g + (i - (len(names) - 1) / 2) * width
            v = values.get(name)
            colour = BAR_COLOURS[i % len(BAR_COLOURS)]
            if v is None:
                note = next((c.note for c in row.candidates if c.name == name), "")
                reason = "n/a" if name not in values else (note if 0 < len(note) <= 16
                                                           else "infeasible")
                ax.text(x, 0.02, reason, rotation=90, ha="center", va="bottom", fontsize=7.5,
                        color=colour)
                continue
            ax.bar(x, v, width * 0.92, color=colour, edgecolor="black", linewidth=0.4)
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7.5)
            top = max(top, v)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"GBS {r.global_batch_size}" for r in rows], fontsize=9)
    with_single = all(r.single_device_ms is not None for r in rows) and baseline is None
    ax.set_ylabel("speedup over one device" if with_single
                  else f"speedup over {baseline or rows[0].candidates[0].name}", fontsize=9)
    ax.set_ylim(0, top * 1.18 + 0.1)
    ax.grid(axis="y", linestyle=":", linewidth=0.5, alpha=0.6)
    ax.set_axisbelow(True)
    ax.legend(handles=[Patch(facecolor=BAR_COLOURS[i % len(BAR_COLOURS)], edgecolor="black",
                             linewidth=0.4, label=n) for i, n in enumerate(names)],
              fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.12),
              ncol=min(len(names), 4), frameon=False)
    # Wrap long titles (topology descriptions) to the figure's width.
    ax.set_title("\n".join(textwrap.wrap(title or "speedup of each strategy",
                                          int(fig.get_figwidth() * 11))), fontsize=10)
    fig.tight_layout()
    return fig


def _fmt(v: Optional[float], digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def table_rows(rows: Sequence[ReportRow], baseline: Optional[str] = None) -> List[List[str]]:
    """The plan table as text cells (header first), shared by the HTML and markdown forms."""
    header = ["GBS", "strategy", "shape", "stages (first, last) @ [devices]", "micro-batches",
              "schedule (K)", "formula ms", "simulated ms", "sim / formula", "speedup", "note"]
    out = [header]
    for row in rows:
        values = speedups(row, baseline)
        for c in row.candidates:
            p = c.plan
            formula = c.formula_ms()
            simulated = c.simulation.batch_ms if c.simulation is not None else None
            ratio = simulated / formula if (simulated is not None and formula) else None
            out.append([str(row.global_batch_size), c.name,
                        p.shape() if p is not None else "-",
                        stage_notation(p) if p is not None else "-",
                        str(p.micro_batches) if p is not None else "-",
                        f"{p.schedule} {p.warmup_depths()}" if p is not None else "-",
                        _fmt(formula), _fmt(simulated), _fmt(ratio, 3),
                        _fmt(values.get(c.name), 3), c.note])
    return out


def _pictures(rows: Sequence[ReportRow], baseline, title) -> List[tuple]:
    """[(caption, Figure)] in report order."""
    pictures = [("speedups", speedup_figure(rows, baseline, title=f"{title}: speedups "
                                                                  f"(simulated iterations)"))]
    for row in rows:
        best = row.candidates[0]
        if best.simulation is not None and best.plan is not None:
            pictures.append((f"timeline of {best.name} at global batch {row.global_batch_size}",
                             timeline_figure(best.simulation, best.plan,
                                             title=f"{best.name}, GBS {row.global_batch_size}, "
                                                   f"plan {best.plan.shape()}, "
                                                   f"{best.plan.micro_batches} micro-batches, "
                                                   f"warm-up K = "
                                                   f"{best.plan.warmup_depths()}")))
        if row.held:
            pictures.append((f"activations held at global batch {row.global_batch_size}",
                             held_activations_figure(row.held, stages=held_stages(best.plan))))
    return pictures


def check_report_path(path: str) -> None:
    """Refuse a report path before any planning work: wrong suffix or missing directory."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".html", ".htm", ".md"):
        raise ValueError(f"report path {path!r} must end in .html (one self-contained file) or "
                         f".md (markdown with PNG pictures next to it)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"report path {path!r}: directory {directory!r} does not exist; "
                         f"create it first")


def write_report(path: str, rows: Sequence[ReportRow], title: str = "dapple strategy report",
                 baseline: Optional[str] = None, notes: Sequence[str] = ()) -> List[str]:
    """Write the report; return the paths written (the report, and PNGs for markdown)."""
    check_report_path(path)
    if not rows:
        raise ValueError("write_report needs at least one ReportRow")
    for row in rows:
        if not row.candidates:
            raise ValueError(f"global batch {row.global_batch_size}: no candidates to report")
    ext = os.path.splitext(path)[1].lower()
    pictures = [(caption, figure_png(fig)) for caption, fig in _pictures(rows, baseline, title)]
    table = table_rows(rows, baseline)
    schedules = [(f"Schedules on the DAPPLE plan at global batch {row.global_batch_size} "
                  f"(simulated)", schedule_table(row.schedules)) for row in rows if row.schedules]
    schedules += [(f"{RELAXED_CAPTION} (global batch {row.global_batch_size})",
                   relaxed_table(row.schedules)) for row in rows
                  if row.schedules and any(o.relaxed for o in row.schedules)]
    if ext == ".md":
        return _write_markdown(path, title, notes, table, pictures, schedules)
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    parts += [f"<p>{html.escape(n)}</p>" for n in notes]
    parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in table[0]) +
                 "</tr>")
    for cells in table[1:]:
        parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    parts.append("</table>")
    for caption, cells in schedules:
        parts.append(f"<h2>{html.escape(caption)}</h2><table><tr>" +
                     "".join(f"<th>{html.escape(h)}</th>" for h in cells[0]) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                  for row in cells[1:]]
        parts.append("</table>")
    for caption, png in pictures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,"
                     f"{data}'><figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    return [path]


def _write_markdown(path, title, notes, table, pictures, schedules=()) -> List[str]:
    stem = os.path.splitext(path)[0]
    written = []
    lines = [f"# {title}", ""] + [f"{n}\n" for n in notes]
    lines.append("| " + " | ".join(table[0]) + " |")
    lines.append("|" + "---|" * len(table[0]))
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
              for cells in table[1:]]
    lines.append("")
    for caption, cells in schedules:
        lines += [f"## {caption}", ""] + markdown_table(cells) + [""]
    for i, (caption, png) in enumerate(pictures):
        picture = f"{stem}_{i}.png"
        with open(picture, "wb") as f:
            f.write(png)
        written.append(picture)
        lines += [f"![{caption}]({os.path.basename(picture)})", "", f"*{caption}*", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return [path] + written


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1400px}"
        "table{border-collapse:collapse;font-size:0.9em}"
        "th,td{border:1px solid #bbb;padding:0.25em 0.6em;text-align:left}"
        "th{background:#eee}figure{margin:1.5em 0}img{max-width:100%}"
        "figcaption{font-style:italic;color:#444}")
