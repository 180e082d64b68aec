"""The lighthouse's operator views: the /status snapshot and the HTML page that shows it.

Pure functions of the lighthouse's state, so the page can be checked without a server. The
page is self-contained (no scripts, no external assets: the loss curves and the timeline are
inline SVG) and refreshes itself every 2 s; every value that came from a request (group ids
above all) is escaped. The saved page (``render_saved_html``), written into the run directory
as the lighthouse stops, is the same drawing with its data inlined: it opens from disk.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from typing import Any

from diloco.config.cluster import QuorumRules
from diloco.ft.protocol import GroupProgress
from diloco.ft.quorum import JobEnd, Quorum, QuorumBook

REFRESH_S = 2
TIMELINE_EVENTS = 500
CURVE_POINTS = 400  # per group; a full curve is thinned to every other point, so the whole run fits
# What /status and the page show at many groups (experiments/scale/lighthouse_scale.py): at 1,000
# groups every point of every curve made /status 12 MB (1.6 s to encode, asked twice a second by the
# launcher's watch) and the page 9 MB; beyond these, curves are thinned, names cut short and the
# timeline marks each quorum once rather than once per member.
SHOWN_POINTS = 6_400  # over all curves: every point of 16 groups' curves, 6 of each at 1,000 groups
SHOWN_NAMES = 30  # participants named per quorum on the page
TICK_ROWS = 100  # groups up to which the timeline marks every member of every quorum
# Past this many groups the page draws the loss band (mean, least and greatest over all groups)
# instead of a line per group: at 1,000 groups a line each was most of the page's time and its
# legend ran off the drawing.
LINE_GROUPS = 16
BAND_BINS = 200  # step bins of the loss band, each twice as wide whenever the run outgrows them
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
EVENT_COLORS = {
    "joined": "#1f77b4",
    "lost": "#d62728",
    "heal": "#2ca02c",
    "cut": "#ff7f0e",  # two groups found unable to reach each other
    "whole": "#9467bd",  # and reaching each other again
    "end": "#000000",
}


class Curve:
    """One group's (inner step, loss) points from its signs of life, at most ``CURVE_POINTS``: its
    train loss, or its eval loss at the step it was measured at."""

    def __init__(self, limit: int = CURVE_POINTS) -> None:
        self.limit = limit
        self.points: list[tuple[int, float]] = []

    def add(self, step: int, loss: float) -> bool:
        """A new point (True); one at the last step again adds nothing (False). One before the
        last (a group restarted from a checkpoint or sent back by a heal, or a heartbeat overtaken
        by the same group's commit) replaces the points from its step on: the curve goes on from
        there, and an overtaken report costs the points after it, not the whole curve."""
        if self.points and step == self.points[-1][0]:
            return False
        if self.points and step < self.points[-1][0]:
            self.points = [point for point in self.points if point[0] < step]
        self.points.append((step, loss))
        if len(self.points) > self.limit:
            self.points = self.points[::2]
        return True


class LossBand:
    """Train loss over all groups against the inner step: per bin of steps the mean, least and
    greatest loss heard, in at most ``limit`` bins. O(1) per point and mergeable, so it costs the
    same at 1,000 groups as at 2; a diverging group shows as the band's top edge."""

    def __init__(self, limit: int = BAND_BINS) -> None:
        self.limit = limit
        self.width = 1  # steps per bin
        self.bins: dict[int, list[float]] = {}  # bin -> [count, sum, least, greatest]

    def add(self, step: int, loss: float) -> None:
        cell = self.bins.get(step // self.width)
        if cell is not None:
            cell[0] += 1
            cell[1] += loss
            cell[2] = min(cell[2], loss)
            cell[3] = max(cell[3], loss)
            return
        self.bins[step // self.width] = [1, loss, loss, loss]
        while len(self.bins) > self.limit:
            self._widen()

    def _widen(self) -> None:
        self.width *= 2
        merged: dict[int, list[float]] = {}
        for b, (count, total, least, greatest) in self.bins.items():
            cell = merged.get(b // 2)
            if cell is None:
                merged[b // 2] = [count, total, least, greatest]
            else:
                cell[:] = [cell[0] + count, cell[1] + total, min(cell[2], least), max(cell[3], greatest)]
        self.bins = merged

    def rows(self) -> list[tuple[int, float, float, float]]:
        """(first step of the bin, mean, least, greatest) per bin, by step."""
        return [(b * self.width, c[1] / c[0], c[2], c[3]) for b, c in sorted(self.bins.items())]


class StatusBoard:
    """What the lighthouse keeps for the status page only: each group's progress, as its latest
    sign of life (heartbeat, quorum ask or commit) reported it, its train and eval loss curves, and
    a timeline of joins, losses, heals and the end. It decides nothing."""

    def __init__(self) -> None:
        self.latest: dict[str, GroupProgress] = {}
        self.curves: dict[str, Curve] = {}
        self.evals: dict[str, Curve] = {}  # eval points: every sign of life repeats the latest, kept once
        self.band = LossBand()
        self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE_EVENTS)
        self.committed_at: dict[str, int] = {}  # group -> the inner step of its last commit
        self._healthy: set[str] = set()

    def progress(self, group: str, progress: GroupProgress) -> None:
        self.latest[group] = progress
        if progress.train_loss is not None and progress.inner_step > 0:
            if self.curves.setdefault(group, Curve()).add(progress.inner_step, progress.train_loss):
                self.band.add(progress.inner_step, progress.train_loss)
        if progress.eval_loss is not None and progress.eval_step is not None:
            self.evals.setdefault(group, Curve()).add(progress.eval_step, progress.eval_loss)

    def committed(self, group: str) -> None:
        """``group`` committed a round at the inner step its latest sign of life reported."""
        self.committed_at[group] = self.latest.get(group, GroupProgress()).inner_step

    def membership(self, healthy: set[str]) -> None:
        """Events for the groups that started or stopped heartbeating since the last call."""
        for group in sorted(healthy - self._healthy):
            self.event("joined", group)
        for group in sorted(self._healthy - healthy):
            self.event("lost", group, "no heartbeat within cluster.timeouts.heartbeat")
        self._healthy = set(healthy)

    def quorum_formed(self, quorum: Quorum) -> None:
        for group, source in sorted(quorum.heal_from.items()):
            self.event("heal", group, f"from {source} in quorum {quorum.quorum_id}")

    def event(self, kind: str, group: str, detail: str = "") -> None:
        self.timeline.append({"time": time.time(), "kind": kind, "group": group, "detail": detail})


@dataclasses.dataclass(frozen=True)
class StatusSnapshot:
    """What /status shows, copied under the lighthouse's lock: containers copied, their immutable
    records (progress, quorums, the end) shared. Building the JSON from it happens after the lock
    is released: at 1,000 groups building it under the lock took 40-380 ms, during which every
    heartbeat, ask and commit waited on the request loop."""

    job_id: str
    signature: str | None
    now: float  # the lighthouse's clock
    last_heartbeat: dict[str, float]
    healthy: frozenset[str]
    pending: frozenset[str]
    finished: frozenset[str]
    steps: dict[str, int]
    progress: dict[str, GroupProgress]
    curves: dict[str, list[tuple[int, float]]]  # already thinned to what is shown
    evals: dict[str, list[tuple[int, float]]]  # (inner step, eval loss) per group, thinned as ``curves``
    loss_band: list[tuple[int, float, float, float]]
    current: tuple[Quorum, float] | None
    history: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    ended: JobEnd | None
    rules: QuorumRules
    cuts: list[dict[str, Any]]  # Reachability.status: the pairs that cannot meet now
    committed_at: dict[str, int]  # StatusBoard.committed_at


def snapshot(
    job_id: str,
    signature: str | None,
    book: QuorumBook,
    steps: Mapping[str, int],
    current: tuple[Quorum, float] | None,
    history: Iterable[dict[str, Any]],
    now: float,
    board: StatusBoard,
) -> StatusSnapshot:
    """The lighthouse's state as /status shows it, cheap to take under its lock (see ``StatusSnapshot``)."""
    per_curve = SHOWN_POINTS // max(len(board.curves), 1)
    per_eval = SHOWN_POINTS // max(len(board.evals), 1)
    return StatusSnapshot(
        job_id=job_id,
        signature=signature,
        now=now,
        last_heartbeat=dict(book.last_heartbeat),
        healthy=frozenset(book.healthy(now)),
        pending=frozenset(book.pending),
        finished=frozenset(book.finished),
        steps=dict(steps),
        progress=dict(board.latest),
        curves={g: list(_thinned(curve.points, per_curve)) for g, curve in board.curves.items()},
        evals={g: list(_thinned(curve.points, per_eval)) for g, curve in board.evals.items()},
        loss_band=board.band.rows(),
        current=current,
        history=[dict(h) for h in history],  # an entry's grants_sent_at is set after the lock (lighthouse._stamp_sent)
        timeline=list(board.timeline),
        ended=book.ended,
        rules=book.rules,
        cuts=book.reach.status(now),
        committed_at=dict(board.committed_at),
    )


def build_status(snap: StatusSnapshot) -> dict[str, Any]:
    """The /status JSON: groups, the current quorum and recent ones, the rules, each group's
    train loss curve and its eval points (``eval_curves``, [inner step, eval loss] each), the loss
    band over all groups ([first step, mean, least, greatest] per bin of steps) and the timeline of
    joins, losses, heals and the end. No secrets. Once the job has ended no group is waiting for a
    quorum, whatever asks it left behind: none will be formed.

    ``now`` and ``current``'s formation time are on the lighthouse's clock; ``history`` and
    ``timeline`` hold wall-clock times, and ``now`` in the answer is wall-clock too.
    """
    now = snap.now
    groups = [
        {
            "id": g,
            "step": snap.steps.get(g),
            "since_heartbeat_s": round(now - t, 3),
            "healthy": g in snap.healthy,
            "waiting_for_quorum": g in snap.pending and snap.ended is None,
            "finished": g in snap.finished,
            # What it trained that no commit of its carries yet: a window's worth while rounds form.
            "steps_since_commit": max(0, snap.progress.get(g, GroupProgress()).inner_step - snap.committed_at[g])
            if g in snap.committed_at
            else None,
        }
        | snap.progress.get(g, GroupProgress()).to_json()
        for g, t in sorted(snap.last_heartbeat.items())
    ]
    current = snap.current
    quorum = None if current is None else {**current[0].to_json(), "age_s": round(now - current[1], 3)}
    return {
        "job": snap.job_id,
        "model_signature": snap.signature,
        "now": time.time(),
        "groups": groups,
        "quorum": quorum,
        "ended": None if snap.ended is None else snap.ended.to_json(),
        "history": snap.history,
        "timeline": snap.timeline,
        "curves": dict(sorted(snap.curves.items())),
        "eval_curves": dict(sorted(snap.evals.items())),
        "loss_band": snap.loss_band,
        "reachability": {"cuts": snap.cuts},
        "rules": dataclasses.asdict(snap.rules),
    }


def render_html(status: Mapping[str, Any]) -> str:
    """The live page: ``status`` (the /status JSON) as tables and drawings, refreshed every ``REFRESH_S``."""
    return _page(
        status, f'<meta http-equiv="refresh" content="{REFRESH_S}">', '<p>JSON: <a href="/status">/status</a></p>'
    )


def render_saved_html(status: Mapping[str, Any]) -> str:
    """The page as a file that outlives the lighthouse: the same tables and drawings, no refresh
    and no link to the lighthouse, and ``status`` itself inlined (``<script id="status">``, data
    only, never run) for whoever wants the numbers behind the drawings."""
    data = json.dumps(status).replace("<", "\\u003c")  # no "</script>" in a group id ends the element early
    return _page(
        status,
        "",
        "<p>saved as the lighthouse stopped; its /status JSON is inlined in this file "
        f'(script id="status")</p><script type="application/json" id="status">{data}</script>',
    )


def _page(status: Mapping[str, Any], head: str, foot: str) -> str:
    """A small page with the same content as ``status`` (the /status JSON), as tables and inline SVG;
    ``head`` and ``foot`` are what the live page and the saved one differ in."""
    groups = _table(
        ["group", "inner step", "steps since its last commit", "train loss", "tokens/s (last logged steps)"]
        + ["eval loss (at step)", "committed round", "digest", "since heartbeat (s)", "healthy"]
        + ["waiting for quorum", "finished"],
        [
            [
                g["id"],
                g.get("inner_step", "-"),
                "-" if g.get("steps_since_commit") is None else g["steps_since_commit"],
                _number(g.get("train_loss"), ".4f"),
                _number(g.get("tokens_per_s"), ",.0f"),
                "-" if g.get("eval_loss") is None else f"{g['eval_loss']:.4f} (step {g['eval_step']})",
            ]
            + [g["step"], g.get("digest", "-")[:12], g["since_heartbeat_s"], g["healthy"], g["waiting_for_quorum"]]
            + [g["finished"]]
            for g in status["groups"]
        ],
    )
    end = status["ended"]
    ended = (
        ""
        if end is None
        else f"<p><b>the job ended at round {end['round']}</b>; saved by {escape(', '.join(end['holders']))}</p>"
    )
    ids = sorted({g["id"] for g in status["groups"]} | set(status["curves"]) | set(status["eval_curves"]))
    color = {g: COLORS[i % len(COLORS)] for i, g in enumerate(ids)}
    q = status["quorum"]
    current = (
        "<p>no quorum yet</p>" if q is None else _table(QUORUM_HEADER + ["age (s)"], [_quorum_row(q) + [q["age_s"]]])
    )
    history = _table(
        QUORUM_HEADER + ["formed at"], [_quorum_row(h) + [_clock(h["formed_at"])] for h in reversed(status["history"])]
    )
    cuts = status.get("reachability", {}).get("cuts", [])
    reachability = (
        "<p>every group reaches every other (as far as their probes found)</p>"
        if not cuts
        else _table(
            ["groups", "state", "for (s)", "times cut", "latest probes"],
            [
                [" and ".join(c["groups"]), "cut" if c["cut"] else "whole again, held apart (it flapped)"]
                + [
                    c["for_s"],
                    c["times_cut"],
                    ", ".join(f"{k}: {'reached' if v else 'not reached'}" for k, v in c["reached"].items()),
                ]
                for c in cuts
            ],
        )
    )
    rules = _table(["rule", "value"], [[k, v] for k, v in status["rules"].items()])
    job = escape(str(status["job"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8">{head}
<title>lighthouse: {job}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #bbb;padding:.2em .6em;text-align:left}}th{{background:#eee}}</style></head>
<body><h1>lighthouse: job {job}</h1>
<p>model signature {escape(str(status["model_signature"]))}; at {_clock(status["now"])}</p>
{ended}<h2>groups</h2>{groups}
<h2>loss</h2>{loss_svg(status["curves"], status["loss_band"], status["eval_curves"], color)}
<h2>timeline</h2>{timeline_svg(status["timeline"], status["history"], ids, status["now"])}
<h2>who cannot reach whom</h2>{reachability}
<h2>current quorum</h2>{current}<h2>recent quorums</h2>{QUORUM_NOTE}{history}
<h2>rules</h2>{rules}{foot}</body></html>
"""


# Each quorum's ids: the round's own, and the quorum id, which only changes with the membership.
QUORUM_HEADER = ["round id", "quorum (lane) id", "participants", "max round", "heal from"]
QUORUM_NOTE = (
    "<p>round id: each formation's own number (the lighthouse log's &quot;quorum N&quot;); quorum (lane) id: "
    "the lanes' (the log's &quot;lane N&quot;), the same from round to round while the membership holds, "
    "a new one whenever the lanes are rebuilt</p>"
)


def _quorum_row(q: Mapping[str, Any]) -> list[Any]:
    return [q["round_id"], q["quorum_id"], shown_names(q["participants"]), q["max_step"], _heal(q["heal_from"])]


WIDTH, HEIGHT, MARGIN = 720, 240, 48
# The loss drawing's plot: room on its left for the loss ticks and the axis' name, on its right for
# the last step's tick, below for the steps' and the notes; above it, a row per row of the legend.
PLOT_LEFT, PLOT_RIGHT, BELOW = 64, WIDTH - 24, 36
LEGEND_ROW, LEGEND_COLUMN = 14, 110
TICKS = 5  # about this many tick values per axis
# Losses above this many times the 98th percentile (a diverging group's) are drawn at the top, the
# drawing saying so: below it every loss is in range, the first steps' included.
CLIP_RATIO = 3.0
EVAL_COLOR = "#000000"  # the band's mean eval loss


def loss_svg(curves: Mapping[str, list], band: list, evals: Mapping[str, list], color: Mapping[str, str]) -> str:
    """Each group's train loss (a line) and eval loss (dots) against its inner step as inline SVG: a
    line per group up to ``LINE_GROUPS`` groups, past them the band over all groups (least to
    greatest, and the mean) and the mean eval loss at each step."""
    drawn = {g: points for g, points in curves.items() if points}
    if not drawn:
        return "<p>no loss reported yet</p>"
    evaluated = {g: points for g, points in evals.items() if points}
    if len(drawn) > LINE_GROUPS:
        return _band_svg(band, len(drawn), _mean_by_step(evaluated))
    names = sorted(drawn.keys() | evaluated.keys())
    per_row = (PLOT_RIGHT - PLOT_LEFT) // LEGEND_COLUMN  # 16 names fit in four rows
    shown = [point for points in [*drawn.values(), *evaluated.values()] for point in points]
    key = "lines: train loss; dots: eval loss" if evaluated else ""
    frame, x, y, height = _loss_frame(shown, key, -(-len(names) // per_row))
    lines = []
    for g, points in sorted(drawn.items()):
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        lines.append(f'<polyline fill="none" stroke="{color[g]}" stroke-width="1.5" points="{coords}"/>')
    dots = "".join(
        f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{color[g]}"/>'
        for g, points in sorted(evaluated.items())
        for s, v in points
    )
    legend = "".join(
        f'<text x="{PLOT_LEFT + LEGEND_COLUMN * (i % per_row)}" y="{14 + LEGEND_ROW * (i // per_row)}" '
        f'fill="{color[g]}" font-size="12">{escape(g[:14])}</text>'
        for i, g in enumerate(names)
    )
    label = "train and eval loss of each group against its inner step"
    return _svg(frame + "".join(lines) + dots + legend, label, height)


def _band_svg(band: list, groups: int, evals: list[tuple[int, float]]) -> str:
    """The band over all groups; ``evals``: the mean eval loss at each step, as dots."""
    shown = [(s, v) for s, _, least, greatest in band for v in (least, greatest)] + evals
    frame, x, y, height = _loss_frame(shown, "black dots: the groups' mean eval loss" if evals else "", 1)
    edge = [(s, greatest) for s, _, _, greatest in band] + [(s, least) for s, _, least, _ in reversed(band)]
    area = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in edge)
    mean = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v, _, _ in band)
    dots = "".join(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{EVAL_COLOR}"/>' for s, v in evals)
    body = (
        f'<polygon fill="{COLORS[0]}" fill-opacity="0.25" stroke="none" points="{area}"/>'
        f'<polyline fill="none" stroke="{COLORS[0]}" stroke-width="1.5" points="{mean}"/>{dots}'
        f'<text x="{PLOT_LEFT}" y="14" font-size="12" fill="{COLORS[0]}">mean over {groups:,} groups; '
        "the band: least to greatest</text>"
    )
    label = "train loss over all groups against the inner step: mean, least and greatest; the mean eval loss"
    return _svg(frame + body, label, height)


def _mean_by_step(curves: Mapping[str, list]) -> list[tuple[int, float]]:
    """The mean over groups of their points at each step: groups evaluate at the same steps
    (every ``trainer.eval_every``), so a thousand groups' evaluations make one dot per step."""
    at: dict[int, list[float]] = {}
    for points in curves.values():
        for s, v in points:
            at.setdefault(s, []).append(v)
    return [(s, sum(vs) / len(vs)) for s, vs in sorted(at.items())]


def _loss_frame(points: list[tuple[int, float]], key: str, legend_rows: int) -> tuple[str, Any, Any, int]:
    """The axes of a drawing of (inner step, loss) ``points`` with their names and tick values, its
    scales and its height, below ``legend_rows`` rows of legend; ``key`` (if any: eval points are
    drawn) says which marks are which. The loss axis holds every loss but those ``_loss_top``
    leaves out, which are drawn at its top (``y`` clips them), the drawing naming how many."""
    height = HEIGHT + LEGEND_ROW * legend_rows
    plot_top, plot_bottom = 8 + LEGEND_ROW * legend_rows, height - BELOW
    losses = sorted(v for _, v in points)
    loss_ticks = _nice_ticks(losses[0], _loss_top(losses))
    low, top = loss_ticks[0][0], loss_ticks[-1][0]
    first, last = min(s for s, _ in points), max(s for s, _ in points)
    x = _scale(first, last, PLOT_LEFT, PLOT_RIGHT)
    to_y = _scale(low, top, plot_bottom, plot_top)
    marks = [f'<path d="M{PLOT_LEFT},{plot_top}V{plot_bottom}H{PLOT_RIGHT}" fill="none" stroke="#888"/>']
    for value, label in loss_ticks:
        py = to_y(value)
        marks.append(
            f'<line x1="{PLOT_LEFT}" x2="{PLOT_RIGHT}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
            f'<text x="{PLOT_LEFT - 4}" y="{py + 4:.1f}" font-size="11" text-anchor="end">{label}</text>'
        )
    for value, label in _nice_ticks(first, last, whole=True):
        if first <= value <= last:  # the steps drawn are not widened to round ones: no empty stretch
            px = x(value)
            marks.append(
                f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{plot_bottom}" y2="{plot_bottom + 4}" stroke="#888"/>'
                f'<text x="{px:.1f}" y="{plot_bottom + 16}" font-size="11" text-anchor="middle">{label}</text>'
            )
    marks.append(
        f'<text transform="rotate(-90)" x="{-(plot_top + plot_bottom) / 2:.0f}" y="14" font-size="12" '
        f'text-anchor="middle">{"train and eval loss" if key else "train loss"}</text>'
        f'<text x="{(PLOT_LEFT + PLOT_RIGHT) / 2:.0f}" y="{height - 4}" font-size="12" text-anchor="middle">'
        "inner step</text>"
    )
    if key:
        marks.append(f'<text x="{PLOT_LEFT}" y="{height - 4}" font-size="11">{key}</text>')
    clipped = len(losses) - bisect.bisect_right(losses, top)
    if clipped:
        marks.append(
            f'<text x="{WIDTH - 8}" y="{height - 4}" font-size="11" text-anchor="end" fill="{COLORS[3]}">'
            f"clipped above {loss_ticks[-1][1]}: {clipped:,} point{'s' if clipped > 1 else ''}, "
            f"up to {losses[-1]:.4g}</text>"
        )
    return "".join(marks), x, lambda v: to_y(min(v, top)), height


def _loss_top(losses: list[float]) -> float:
    """The greatest of ``losses`` (sorted) that the loss axis holds: every one, but for a few
    extreme ones, above ``CLIP_RATIO`` times the 98th percentile, which would flatten the rest."""
    limit = CLIP_RATIO * losses[int(0.98 * (len(losses) - 1))]
    return losses[bisect.bisect_right(losses, limit) - 1]


def _nice_ticks(low: float, high: float, whole: bool = False) -> list[tuple[float, str]]:
    """Round tick values and their labels from the last at or below ``low`` to the first at or
    above ``high``: about ``TICKS`` of them, a step of 1, 2 or 5 times a power of ten apart (at
    least 1 where ``whole``: inner steps), always at least two."""
    raw = max((high - low) / TICKS, 1.0 if whole else 0.0) or abs(high) / TICKS or 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    first = math.floor(low / step + 1e-9)
    last = max(math.ceil(high / step - 1e-9), first + 1)
    digits = max(0, math.ceil(round(-math.log10(step), 9)))
    return [(k * step, f"{k * step:,.{digits}f}") for k in range(first, last + 1)]


def timeline_svg(events: list[dict[str, Any]], history: list[dict[str, Any]], ids: list[str], now: float) -> str:
    """One row per group over wall time: quorums it took part in (grey ticks), joins, losses,
    heals (coloured marks) and the job's end (a black line), as inline SVG. Past ``TICK_ROWS``
    groups, rows only for the groups with a loss or heal in the timeline (the latest
    ``TICK_ROWS`` of them): a thousand rows of joins made the drawing 22,000 pixels tall."""
    times = [e["time"] for e in events] + [h["formed_at"] for h in history]
    if not times or not ids:
        return "<p>nothing yet</p>"
    many = len(ids) > TICK_ROWS
    rows = _eventful(events, ids) if many else ids
    row = {g: 24 + 22 * i for i, g in enumerate(rows)}
    height = 24 + 22 * len(rows) + 16 + (14 if many else 0)
    x = _scale(min(times), max(now, max(times) + 1e-3), MARGIN + 40, WIDTH - 8)
    marks = [f'<text x="2" y="{row[g] + 4}" font-size="11">{escape(g[:14])}</text>' for g in rows]
    for h in history:
        if many:  # one mark per quorum: a thousand rows of ticks made the page megabytes
            px = x(h["formed_at"])
            marks.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="8" y2="{height - 14}" stroke="#ddd"/>')
            continue
        for g in h["participants"]:
            if g in row:
                px = x(h["formed_at"])
                marks.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{row[g] - 6}" y2="{row[g] + 6}" stroke="#bbb"/>')
    for e in events:
        if many and e["kind"] != "end" and e.get("group") not in row:
            continue
        px, fill = x(e["time"]), EVENT_COLORS.get(e["kind"], "#000")
        title = f"<title>{escape(e['kind'])} {escape(e.get('group', ''))} {escape(e.get('detail', ''))}</title>"
        if e["kind"] == "end" or e.get("group") not in row:
            marks.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="8" y2="{height - 14}" stroke="{fill}">{title}</line>')
        else:
            marks.append(f'<circle cx="{px:.1f}" cy="{row[e["group"]]}" r="4" fill="{fill}">{title}</circle>')
    legend = " ".join(f'<tspan fill="{c}">{k}</tspan>' for k, c in EVENT_COLORS.items())
    marks.append(
        f'<text x="{MARGIN + 40}" y="{height - 2}" font-size="11">{legend} <tspan fill="#888">quorum</tspan></text>'
    )
    if many:
        marks.append(
            f'<text x="{MARGIN + 40}" y="{height - 16}" font-size="11">{len(ids) - len(rows):,} of {len(ids):,} '
            "groups have no loss or heal here and no row (/status has every event)</text>"
        )
    return _svg("".join(marks), "joins, losses, heals and quorums of each group over time", height)


def _eventful(events: list[dict[str, Any]], ids: list[str]) -> list[str]:
    """The groups with a loss or heal among ``events``, the latest ``TICK_ROWS``, in ``ids``' order."""
    latest = {e["group"]: i for i, e in enumerate(events) if e["kind"] in ("lost", "heal")}
    kept = set(sorted(latest, key=latest.__getitem__)[-TICK_ROWS:])
    return [g for g in ids if g in kept]


def _svg(body: str, label: str, height: int = HEIGHT) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{escape(label)}" style="border:1px solid #ddd">{body}</svg>'
    )


def _scale(low: float, high: float, start: float, end: float) -> Any:
    span = (high - low) or 1.0
    return lambda v: start + (v - low) / span * (end - start)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _thinned(points: list, limit: int) -> list:
    """At most about ``limit`` (at least 2) evenly spaced points, the last one kept."""
    step = -(-len(points) // max(limit, 2))
    return points if step <= 1 else points[::step] + ([points[-1]] if (len(points) - 1) % step else [])


def shown_names(participants: Sequence[str]) -> str:
    """Up to ``SHOWN_NAMES`` participants by name, then their number: the page's and the log's form."""
    shown = ", ".join(participants[:SHOWN_NAMES])
    return shown if len(participants) <= SHOWN_NAMES else f"{shown}, ... ({len(participants)} groups)"


def _heal(heal_from: Mapping[str, str]) -> str:
    return ", ".join(f"{g} <- {src}" for g, src in sorted(heal_from.items())) or "-"


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))
