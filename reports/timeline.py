"""Pictures of a simulated iteration: the timeline (DAPPLE Fig. 3a/b and 4) and activations held
over time (Fig. 3c).

Timeline: one row per device (a stage's replicas repeat its boxes), then one row per boundary
link (activations in the upper half, gradients in the lower half). Boxes are coloured by kind
and numbered by micro-batch where the number fits; plans with more than `MAX_DEVICE_ROWS`
devices get one row per stage, so the picture stays readable.

matplotlib (the `report` extra) is imported inside the functions, with the object API (no
pyplot, no global backend switch), so importing reports stays light and works without a display.
"""
from __future__ import annotations

import io
from typing import Dict, List, Optional, Sequence, Tuple

from planner.estimate.simulator import (ALLREDUCE_KIND, BACKWARD_INPUT_KIND, BACKWARD_KIND,
                               BACKWARD_WEIGHT_KIND, FORWARD_KIND, SEND_BACKWARD_KIND,
                               SEND_FORWARD_KIND, SimulationResult)

# Colours after the papers' figures: forward blue, backward green (a split backward's I light,
# W dark), bubbles grey.
COLOURS = {
    FORWARD_KIND: "#5b9bd5",
    BACKWARD_KIND: "#70ad47",
    BACKWARD_INPUT_KIND: "#a9d18e",
    BACKWARD_WEIGHT_KIND: "#385723",
    SEND_FORWARD_KIND: "#f4b183",
    SEND_BACKWARD_KIND: "#c55a11",
    ALLREDUCE_KIND: "#9e6ebd",
    "idle": "#e7e6e6",
}
LEGEND_LABELS = {
    FORWARD_KIND: "forward",
    BACKWARD_KIND: "backward",
    BACKWARD_INPUT_KIND: "backward: input gradient (I)",
    BACKWARD_WEIGHT_KIND: "backward: weight gradient (W)",
    SEND_FORWARD_KIND: "transfer: activations",
    SEND_BACKWARD_KIND: "transfer: gradients",
    ALLREDUCE_KIND: "allreduce",
    "idle": "idle (bubble)",
}
MAX_DEVICE_ROWS = 32


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'dapple[report]' "
                          "(or pip install 'matplotlib<3.10')") from None
    from matplotlib.figure import Figure
    return Figure


def device_rows(result: SimulationResult, plan=None) -> List[Tuple[str, int]]:
    """(label, stage) for every row of compute: one per device, or one per stage (device
    group; an interleaved plan's group runs several chunks)."""
    if plan is None:
        return [(f"stage {s}", s) for s in range(result.num_stages)]
    groups = plan.stages[:plan.num_positions]
    if len(groups) != result.num_stages:
        raise ValueError(f"the plan has {len(groups)} stages, the simulation "
                         f"{result.num_stages}")
    if plan.num_devices > MAX_DEVICE_ROWS:
        rows = []
        for s, st in enumerate(groups):
            d = st.devices
            label = f"dev {d[0]}" if len(d) == 1 else f"dev {d[0]}-{d[-1]} (x{len(d)})"
            rows.append((f"{label} | stage {s}", s))
        return rows
    return [(f"dev {d} | stage {s}", s) for s, st in enumerate(groups) for d in st.devices]


def timeline_figure(result: SimulationResult, plan=None, title: Optional[str] = None,
                    show_links: bool = True):
    """A matplotlib Figure of the simulated iteration (see the module docstring)."""
    Figure = require_matplotlib()
    from matplotlib.patches import Patch

    rows = device_rows(result, plan)
    links = [b for b in range(result.num_boundaries)
             if show_links and any(e.duration_ms > 0 for e in result.link_events(b))]
    total_rows = len(rows) + len(links)
    tasks_per_row = max((len(result.stage_events(s)) for s in range(result.num_stages)),
                        default=1)
    width = min(max(8.0, 0.28 * tasks_per_row + 3.0), 40.0)
    height = 1.6 + 0.42 * total_rows + 0.6
    fig = Figure(figsize=(width, height), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    T = result.iteration_ms if result.iteration_ms > 0 else 1.0
    ax.set_xlim(0, T)
    ax.set_ylim(total_rows - 0.5, -0.5)
    # Width of the drawing area in points, to decide where a micro-batch number fits.
    axes_points = width * 72 * 0.82

    def box(y, start, end, kind, label=None, half=None, later_chunk=False):
        top, h = (y - 0.4, 0.8) if half is None else ((y - 0.4, 0.4) if half == "upper"
                                                       else (y, 0.4))
        ax.broken_barh([(start, end - start)], (top, h), facecolors=COLOURS[kind],
                       edgecolors="white" if kind == "idle" else "black", linewidth=0.4,
                       hatch="///" if later_chunk else None)
        if label is not None:
            box_points = (end - start) / T * axes_points
            fontsize = 8 if half is None else 6.5
            if box_points >= 0.62 * fontsize * len(label) + 2:
                ax.text((start + end) / 2, top + h / 2, label, ha="center", va="center",
                        fontsize=fontsize, color="black")

    labels = []
    for y, (label, s) in enumerate(rows):
        labels.append(label)
        busy = sorted((e for e in result.stage_events(s)), key=lambda e: e.start_ms)
        cursor = 0.0
        for e in busy:
            if e.start_ms > cursor:
                box(y, cursor, e.start_ms, "idle")
            if e.duration_ms > 0:
                # An interleaved device's later chunks (chunk >= S) are hatched.
                box(y, e.start_ms, e.end_ms, e.kind,
                    None if e.micro_batch is None else str(e.micro_batch),
                    later_chunk=e.stage >= result.num_stages)
            cursor = max(cursor, e.end_ms)
        if cursor < T:
            box(y, cursor, T, "idle")
    for i, b in enumerate(links):
        y = len(rows) + i
        labels.append(f"link {b}\u2194{b + 1}")
        for e in result.link_events(b):
            if e.duration_ms > 0:
                box(y, e.start_ms, e.end_ms, e.kind, str(e.micro_batch),
                    half="upper" if e.kind == SEND_FORWARD_KIND else "lower")

    ax.set_yticks(range(total_rows))
    ax.set_yticklabels(labels, fontsize=9)
    ax.set_xlabel("time (ms)", fontsize=10)
    ax.tick_params(axis="x", labelsize=9)
    ax.grid(axis="x", linestyle=":", linewidth=0.5, alpha=0.6)
    ax.set_axisbelow(True)
    present = {e.kind for e in result.events if e.duration_ms > 0} | {"idle"}
    handles = [Patch(facecolor=COLOURS[k], edgecolor="black", linewidth=0.4,
                     label=LEGEND_LABELS[k]) for k in COLOURS if k in present]
    axes_inches = 0.42 * total_rows
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / axes_inches),
              ncol=min(len(handles), 6), fontsize=8.5, frameon=False)
    heading = title or "simulated iteration"
    chunked = result.num_boundaries >= result.num_stages       # more chunks than groups
    note = "; hatched: later chunks of a device group" if chunked else ""
    ax.set_title(f"{heading}\niteration {result.iteration_ms:.4g} ms, bubbles "
                 f"{100 * result.bubble_fraction:.1f}% (numbers: micro-batch{note})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def held_activations_figure(results: Dict[str, SimulationResult],
                            stages: Optional[Sequence[int]] = None,
                            title: Optional[str] = None):
    """Micro-batches whose activations a stage holds, over time, one line per schedule
    (Fig. 3c: GPipe's grow to M, early backward's stop at K_i). One panel per stage in
    `stages` (default: the first stage, where the two differ most)."""
    Figure = require_matplotlib()
    if not results:
        raise ValueError("held_activations_figure needs at least one simulation result")
    stages = list(stages) if stages is not None else [0]
    fig = Figure(figsize=(8.0, 1.0 + 2.4 * len(stages)), dpi=110)
    styles = ["-", "--", "-.", ":"]
    colours = ["#c00000", "#2f5597", "#548235", "#7f6000"]
    for i, s in enumerate(stages):
        ax = fig.add_subplot(len(stages), 1, i + 1)
        peak_all = 1
        for j, (name, res) in enumerate(results.items()):
            steps = res.held_over_time(s)
            xs = [t for t, _ in steps] + [res.iteration_ms]
            ys = [c for _, c in steps] + [steps[-1][1]]
            peak = res.stages[s].peak_held_micro_batches
            peak_all = max(peak_all, peak)
            ax.step(xs, ys, where="post", linestyle=styles[j % len(styles)],
                    color=colours[j % len(colours)], linewidth=1.8,
                    label=f"{name} (peak {peak}, iteration {res.iteration_ms:.4g} ms)")
        ax.set_ylim(0, peak_all * 1.5 + 1)   # head room for the legend
        ax.set_ylabel(f"stage {s}\nheld micro-batches", fontsize=9)
        ax.grid(linestyle=":", linewidth=0.5, alpha=0.6)
        ax.legend(fontsize=8.5, loc="upper right")
        ax.tick_params(labelsize=9)
        if i == len(stages) - 1:
            ax.set_xlabel("time (ms)", fontsize=10)
    fig.suptitle(title or "activations held over time", fontsize=10)
    fig.tight_layout()
    return fig


def held_stages(plan) -> List[int]:
    """The stages a held-activations picture shows: the first, where GPipe and early backward
    differ most, and the last."""
    return [0] if plan is None or plan.num_positions == 1 else [0, plan.num_positions - 1]


def save_figure(fig, path: str) -> None:
    # "tight" keeps the legend below the axes inside the picture and trims empty margins.
    fig.savefig(path, format=_format_of(path), bbox_inches="tight")


def figure_png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def _format_of(path: str) -> str:
    ext = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if ext not in ("png", "svg", "pdf"):
        raise ValueError(f"picture path {path!r} must end in .png, .svg or .pdf")
    return ext
