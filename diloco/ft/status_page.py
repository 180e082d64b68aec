"""The lighthouse's operator views: the /status snapshot and the HTML page that shows it.

Pure functions of the lighthouse's state, so the page can be checked without a server. The
page is self-contained (no scripts, no external assets) and refreshes itself every 2 s;
every value that came from a request (group ids above all) is escaped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from html import escape
from typing import Any

from diloco.ft.quorum import Quorum, QuorumBook

REFRESH_S = 2


def build_status(
    job_id: str,
    signature: str | None,
    book: QuorumBook,
    steps: Mapping[str, int],
    current: tuple[Quorum, float] | None,
    history: Iterable[dict[str, Any]],
    now: float,
) -> dict[str, Any]:
    """The /status JSON: groups, the current quorum and recent ones, and the rules. No secrets.

    ``now`` and ``current``'s formation time are on the lighthouse's clock; ``history`` holds
    wall-clock formation times, and ``now`` in the answer is wall-clock too.
    """
    healthy = book.healthy(now)
    groups = [
        {
            "id": g,
            "step": steps.get(g),
            "since_heartbeat_s": round(now - t, 3),
            "healthy": g in healthy,
            "waiting_for_quorum": g in book.pending,
            "finished": g in book.finished,
        }
        for g, t in sorted(book.last_heartbeat.items())
    ]
    quorum = None if current is None else {**current[0].to_json(), "age_s": round(now - current[1], 3)}
    return {
        "job": job_id,
        "model_signature": signature,
        "now": time.time(),
        "groups": groups,
        "quorum": quorum,
        "ended": None if book.ended is None else book.ended.to_json(),
        "history": list(history),
        "rules": dataclasses.asdict(book.rules),
    }


def render_html(status: Mapping[str, Any]) -> str:
    """A small page with the same content as ``status`` (the /status JSON), as tables."""
    groups = _table(
        ["group", "committed round", "since heartbeat (s)", "healthy", "waiting for quorum", "finished"],
        [
            [g["id"], g["step"], g["since_heartbeat_s"], g["healthy"], g["waiting_for_quorum"], g["finished"]]
            for g in status["groups"]
        ],
    )
    end = status["ended"]
    ended = (
        "" if end is None else f"<p><b>the job ended at round {end['round']}</b>; {escape(end['writer'])} saves it</p>"
    )
    q = status["quorum"]
    current = (
        "<p>no quorum yet</p>"
        if q is None
        else _table(
            ["id", "participants", "max round", "heal from", "age (s)"],
            [[q["quorum_id"], ", ".join(q["participants"]), q["max_step"], _heal(q["heal_from"]), q["age_s"]]],
        )
    )
    history = _table(
        ["id", "participants", "max round", "heal from", "formed at"],
        [
            [h["quorum_id"], ", ".join(h["participants"]), h["max_step"], _heal(h["heal_from"]), _clock(h["formed_at"])]
            for h in reversed(status["history"])
        ],
    )
    rules = _table(["rule", "value"], [[k, v] for k, v in status["rules"].items()])
    job = escape(str(status["job"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>lighthouse: {job}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #bbb;padding:.2em .6em;text-align:left}}th{{background:#eee}}</style></head>
<body><h1>lighthouse: job {job}</h1>
<p>model signature {escape(str(status["model_signature"]))}; at {_clock(status["now"])}</p>
{ended}<h2>groups</h2>{groups}<h2>current quorum</h2>{current}<h2>recent quorums</h2>{history}
<h2>rules</h2>{rules}<p>JSON: <a href="/status">/status</a></p></body></html>
"""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _heal(heal_from: Mapping[str, str]) -> str:
    return ", ".join(f"{g} <- {src}" for g, src in sorted(heal_from.items())) or "-"


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))
