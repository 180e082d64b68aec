"""Each cost of ``bench_model_size`` as a line against its bytes: a fixed part and a per-byte part.

A cost measured at several model sizes is fitted as ``ms = fixed + per_gb · GB``, least squares in
relative error (weights 1/ms²): the smallest size sets the fixed part and the largest the
per-byte part, and neither swamps the other across sizes a thousand times apart. Each cost stands
beside its bare figure (the same bytes moved by Gloo, or by the disk, alone), so the table says
which part of a cost is far from the machine: a fixed part is per-round (or per-file) overhead,
a per-byte part above the bare one is a pass over the bytes the bare figure does not make.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.common import NO_MATPLOTLIB, markdown_table, pyplot, save_figure
from experiments.scale.checkpoint_io import KINDS

GB = 1e9


@dataclass(frozen=True)
class Cost:
    """One measured cost of a row of ``bench_model_size`` and the bare figure for the same bytes."""

    name: str
    key: str
    bare: str
    bare_key: str
    bytes_per_param: int  # fp32: the round's Δ, the heal's θ_g, momentum and AdamW moments, a checkpoint's KINDS


COSTS = (
    Cost("round (sync_ms)", "sync_ms", "bare all-reduce", "allreduce_ms", 4),
    Cost("heal transfer", "heal_transfer_ms", "bare send", "send_ms", 16),
    Cost("checkpoint save", "save_ms", "bare write, synced", "raw_write_synced_ms", 4 * len(KINDS)),
    Cost("checkpoint load", "load_ms", "bare read", "raw_read_ms", 4 * len(KINDS)),
)


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(fixed, slope) of y = fixed + slope · x over ``points`` (x, y), weighted by 1/y²; None
    with fewer than two distinct x or any y that is not positive."""
    if len({x for x, _ in points}) < 2 or any(y <= 0 for _, y in points):
        return None
    weights = [1 / y**2 for _, y in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points)) / spread
    return mean_y - slope * mean_x, slope


def _points(rows: list[dict[str, Any]], cost: Cost, key: str) -> list[tuple[float, float]]:
    return [(cost.bytes_per_param * r["parameters"] / GB, float(r[key])) for r in rows if r.get(key) is not None]


def fit_table(rows: list[dict[str, Any]]) -> str:
    """Per cost and its bare figure: the fixed ms, the ms per GB and the per-byte ratio of the two."""
    body = []
    for cost in COSTS:
        fits = [linear_fit(_points(rows, cost, key)) for key in (cost.key, cost.bare_key)]
        if None in fits:
            continue
        (fixed, per_gb), (bare_fixed, bare_per_gb) = fits
        body.append(
            [
                cost.name,
                f"{fixed:,.1f}",
                f"{per_gb:,.0f}",
                cost.bare,
                f"{bare_fixed:,.1f}",
                f"{bare_per_gb:,.0f}",
                f"{per_gb / bare_per_gb:.1f}x" if bare_per_gb > 0 else "n/a",
            ]
        )
    headers = ["cost", "fixed ms", "ms per GB", "bare figure", "its fixed ms", "its ms per GB", "per GB / bare's"]
    return markdown_table(headers, body) if body else "(a fit needs two sizes or more)"


def plot(rows: list[dict[str, Any]], path: Path) -> str:
    """Every cost and its bare figure against the model's parameters, log-log, with their fitted lines."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, len(COSTS), figsize=(4.2 * len(COSTS), 3.8))
    for ax, cost in zip(axes, COSTS):
        for key, label, style in ((cost.key, cost.name, "o-"), (cost.bare_key, cost.bare, "s--")):
            measured = [(r["parameters"], r[key]) for r in rows if r.get(key)]
            if not measured:
                continue
            ax.plot(*zip(*measured), style, label=label)
            fit = linear_fit(_points(rows, cost, key))
            if fit is not None:
                fixed, per_gb = fit
                params = sorted(p for p, _ in measured)
                line = [fixed + per_gb * cost.bytes_per_param * p / GB for p in params]
                if all(ms > 0 for ms in line):  # a negative fixed part has no place on a log scale
                    ax.plot(params, line, ":", color=ax.lines[-1].get_color(), alpha=0.6)
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="ms", title=cost.name)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
