"""The lighthouse's wire protocol: the typed messages both sides send, and the errors clients see.

Plain HTTP + JSON, shared by the server (lighthouse.py) and its clients (client.py), so the
client never imports the server; nothing received is ever unpickled (docs/design.md, invariant 5).
Every request is checked field by field, and a problem is a 400 that names the field. An
error answer carries a machine-readable ``code`` next to the human ``error``: clients act on
the code (``exception_for``), never on the wording.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hmac
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, get_origin, get_type_hints

from diloco.config.redaction import TOKEN_ENV
from diloco.ft.quorum import JobEnd, Quorum

MAX_BODY_BYTES = 64 * 1024
MAX_GROUP_ID_CHARS = 200
MAX_CONFIG_KEYS = 1000
MAX_ENDPOINT_CHARS = 64  # "host:port" of a probe listener: an IPv6 address in brackets and a port fit
# A request nests 3 deep (a config value that is a list); json.loads recurses once per level and
# raised RecursionError on 30,000 brackets, well under MAX_BODY_BYTES.
MAX_JSON_DEPTH = 32
HEARTBEAT_ACK = {"ok": True}  # the answer to a heartbeat, with "probe" added while a cut of the group stands


class ErrorCode(str, enum.Enum):
    """Why the lighthouse answered with an error; each code has one HTTP status (``status``)."""

    BAD_REQUEST = "bad_request"  # malformed body, unknown or mistyped field
    NOT_FOUND = "not_found"  # no such endpoint
    BAD_TOKEN = "bad_token"  # missing or wrong cluster.lighthouse.token
    WRONG_JOB = "wrong_job"  # another job id, model signature or training configuration
    JOB_ENDED = "job_ended"  # the job ended before this (unfinished) group asked
    SUPERSEDED = "superseded"  # the same group sent a newer quorum request
    TIMEOUT = "timeout"  # no quorum containing the group within its wait
    WITHDRAWN = "withdrawn"  # the request was dropped before its wait ran out (see the reason)
    STOPPING = "stopping"  # the lighthouse is shutting down

    @property
    def status(self) -> int:
        return _STATUS[self]


_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.BAD_TOKEN: 401,
    ErrorCode.WRONG_JOB: 409,
    ErrorCode.JOB_ENDED: 409,
    ErrorCode.SUPERSEDED: 409,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.WITHDRAWN: 504,
    ErrorCode.STOPPING: 503,
}


class LighthouseError(RuntimeError):
    """An error answer of the lighthouse: its ``code`` says what happened, the message says it to a person."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        return self.code.status


class LighthouseRefused(LighthouseError):
    """The lighthouse refused the request (token, job id, model signature, malformed request, job
    over): the same request will be refused again, so fix the configuration instead of retrying.
    The lighthouse raises it internally too, and answers with ``status``."""


class QuorumSuperseded(LighthouseError):
    """A newer quorum request of the same group replaced this one (the group's own abandoned
    request): not a refusal, the group simply asks again at its next sync."""


class QuorumTimeout(LighthouseError):
    """No quorum containing this group formed within the requested time; the request is withdrawn."""


class LighthouseUnavailable(RuntimeError):
    """The lighthouse could not be reached or failed (connection refused/reset, timeout, 5xx, stopping)."""


_EXCEPTIONS: dict[ErrorCode, type[LighthouseError]] = {
    ErrorCode.SUPERSEDED: QuorumSuperseded,
    ErrorCode.TIMEOUT: QuorumTimeout,
    ErrorCode.WITHDRAWN: QuorumTimeout,
}


@dataclass(frozen=True)
class ErrorAnswer:
    """The JSON body of every error answer: ``{"error": <for a person>, "code": <ErrorCode>}``."""

    code: ErrorCode
    error: str

    @property
    def status(self) -> int:
        return self.code.status

    def to_json(self) -> dict[str, str]:
        return {"error": self.error, "code": self.code.value}

    @classmethod
    def from_json(cls, data: Any) -> ErrorAnswer:
        """Raises ``ValueError`` unless ``data`` is an error answer of this protocol."""
        if not isinstance(data, dict) or not isinstance(data.get("error"), str):
            raise ValueError(f"not an error answer: {data!r:.200}")
        return cls(ErrorCode(data.get("code")), data["error"])

    def exception(self) -> LighthouseError | LighthouseUnavailable:
        """What a client raises for this answer, chosen by the code alone."""
        if self.code is ErrorCode.STOPPING:
            return LighthouseUnavailable(self.error)
        return _EXCEPTIONS.get(self.code, LighthouseRefused)(self.code, self.error)


# -- requests ------------------------------------------------------------------------------
_TYPES: dict[type, tuple[Callable[[Any], bool], str]] = {
    str: (lambda v: isinstance(v, str), "a string"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    float: (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
        "a positive number of seconds",
    ),
    dict: (
        lambda v: isinstance(v, dict) and len(v) <= MAX_CONFIG_KEYS and all(isinstance(k, str) for k in v),
        f"an object of at most {MAX_CONFIG_KEYS} configuration keys",
    ),
}


@dataclass(frozen=True)
class GroupMessage:
    """What every request carries: who sends it. The lighthouse admits only its own job's groups."""

    path: ClassVar[str]
    job: str
    signature: str
    group: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> GroupMessage:
        """The message, each field type-checked; a problem is a ``LighthouseRefused`` 400 naming the field."""
        if not isinstance(data, dict):
            raise _bad_request(f"the body must be a JSON object, got {type(data).__name__}")
        checks, required = _schema(cls)
        if unknown := data.keys() - checks.keys():
            raise _bad_request(f"unknown field {min(unknown)!r} for {cls.path}; expected {sorted(checks)}")
        if missing := [n for n in required if n not in data]:
            raise _bad_request(f"missing field {missing[0]!r} for {cls.path}; expected {sorted(checks)}")
        for name, value in data.items():
            ok, what = checks[name]
            if not ok(value):
                raise _bad_request(f"field {name!r}={value!r} must be {what}")
        if not 0 < len(data["group"]) <= MAX_GROUP_ID_CHARS:
            raise _bad_request(f"field 'group' must be 1 to {MAX_GROUP_ID_CHARS} characters, got {len(data['group'])}")
        return cls(**data)


@dataclass(frozen=True)
class SignOfLife(GroupMessage):
    """A message the lighthouse takes as a heartbeat (a heartbeat, a quorum ask, a commit).

    Each carries ``progress``, what the status page shows of the group (``GroupProgress``; the
    lighthouse decides nothing from it): a group skips the heartbeat due just after an ask or a
    commit (``LighthouseClient.beat_due_in``), so with rounds faster than heartbeats (a sync
    warm-up's) a page fed by heartbeats alone held a group's first figures for the whole run.
    """

    progress: dict[str, Any] = field(default_factory=dict, kw_only=True)
    reach: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def __post_init__(self) -> None:
        _ = self.group_progress, self.reach_report  # refused (400) here, with the field named, if malformed

    @functools.cached_property
    def group_progress(self) -> GroupProgress:
        """``progress`` parsed once, when the message is made (not a field: it is not sent)."""
        return GroupProgress.from_json(self.progress)

    @functools.cached_property
    def reach_report(self) -> ReachReport:
        """``reach`` parsed once, as ``group_progress``."""
        return ReachReport.from_json(self.reach)


@dataclass(frozen=True)
class Heartbeat(SignOfLife):
    """The group's committed step and the last quorum id it saw, when it has not otherwise spoken for a while."""

    path: ClassVar[str] = "/heartbeat"
    step: int
    quorum_id: int
    finished: bool = False


MAX_DIGEST_CHARS = 64


@dataclass(frozen=True)
class GroupProgress:
    """A group's training progress as its heartbeats report it, for operators only."""

    inner_step: int = 0
    train_loss: float | None = None
    tokens_per_s: float | None = None
    digest: str = ""  # of the group's global state at its last committed round (or heal)
    eval_loss: float | None = None  # of its latest evaluation (``trainer.eval_every``), measured at ``eval_step``
    eval_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        # Flat fields, read directly: asdict's deep copy was most of /status's time at 1,000 groups.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if v not in (None, "")}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupProgress:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise _bad_request(f"unknown progress field {unknown[0]!r}")
        step, digest, eval_step = data.get("inner_step", 0), data.get("digest", ""), data.get("eval_step")
        if not _is_count(step):
            raise _bad_request(f"progress field 'inner_step'={step!r} must be a non-negative integer")
        if not (eval_step is None or _is_count(eval_step)):
            raise _bad_request(f"progress field 'eval_step'={eval_step!r} must be a non-negative integer")
        if not (isinstance(digest, str) and len(digest) <= MAX_DIGEST_CHARS):
            raise _bad_request(f"progress field 'digest' must be a string of at most {MAX_DIGEST_CHARS} characters")
        numbers = {}
        for name in ("train_loss", "tokens_per_s", "eval_loss"):
            value = data.get(name)
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
            ):
                raise _bad_request(f"progress field {name!r}={value!r} must be a finite non-negative number")
            numbers[name] = None if value is None else float(value)
        if (numbers["eval_loss"] is None) != (eval_step is None):  # an eval point is drawn at its step
            raise _bad_request("progress fields 'eval_loss' and 'eval_step' come together or not at all")
        return cls(inner_step=step, digest=digest, eval_step=eval_step, **numbers)


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a non-negative integer as JSON carries one (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class ReachReport:
    """A leader's probe endpoint and its probes of peers since its last report (``diloco.ft.reach``):
    what the lighthouse's reachability matrix is built from. ``port`` 0: it has no listener."""

    port: int = 0
    reached: dict[str, str] = field(default_factory=dict)  # peer -> the "host:port" probed
    unreached: dict[str, str] = field(default_factory=dict)
    mbps: dict[str, float] = field(default_factory=dict)  # peer -> the throughput its link to it was timed at
    round_bytes: int = 0  # what its lane carried in its last round

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReachReport:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise _bad_request(f"unknown reach field {unknown[0]!r}")
        port, round_bytes = data.get("port", 0), data.get("round_bytes", 0)
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535):
            raise _bad_request(f"reach field 'port'={port!r} must be a TCP port (0 to 65535)")
        if not (isinstance(round_bytes, int) and not isinstance(round_bytes, bool) and round_bytes >= 0):
            raise _bad_request(f"reach field 'round_bytes'={round_bytes!r} must be a non-negative integer")
        probed = {
            name: _by_group(data, name, lambda v: isinstance(v, str) and len(v) <= MAX_ENDPOINT_CHARS)
            for name in ("reached", "unreached")
        }
        mbps = _by_group(
            data, "mbps", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
        )
        return cls(port=port, mbps={g: float(r) for g, r in mbps.items()}, round_bytes=round_bytes, **probed)


def _by_group(data: dict[str, Any], name: str, value_ok: Callable[[Any], bool]) -> dict[str, Any]:
    """A reach field that maps group ids to values, checked; a problem is a 400 naming it."""
    value = data.get(name, {})
    if not (
        isinstance(value, dict)
        and len(value) <= MAX_CONFIG_KEYS
        and all(isinstance(g, str) and 0 < len(g) <= MAX_GROUP_ID_CHARS for g in value)
        and all(value_ok(v) for v in value.values())
    ):
        what = "endpoints probed" if name != "mbps" else "positive rates"
        raise _bad_request(f"reach field {name!r} must map at most {MAX_CONFIG_KEYS} group ids to {what}")
    return value


def probe_request_from_json(data: Any) -> dict[str, str]:
    """The peers a heartbeat's answer asks the group to probe again (``{"probe": {group: "host:port"}}``)."""
    probe = data.get("probe", {}) if isinstance(data, dict) else None
    if not (isinstance(probe, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in probe.items())):
        raise ValueError(f"malformed heartbeat answer: {data!r}")
    return probe


@dataclass(frozen=True)
class QuorumAsk(SignOfLife):
    """A long poll for the next quorum (see ``quorum.QuorumRequest`` for ``step`` and ``round_step``).

    It carries the last quorum id the group saw, so a restarted lighthouse never reuses an id
    even if a request reaches it before any heartbeat, and the group's flat training
    configuration, which must match the job's: in full until the group was granted a quorum, then
    its ``config_digest`` alone (2 KB less to read and parse, 1,000 times a round at 1,000 groups;
    experiments/scale/lighthouse_scale.py). ``known_quorum`` is the quorum whose participants the group holds: an id always
    names the same members (``quorum.next_quorum_id``; a restarted lighthouse issues ids above
    every asker's), so a grant of that id leaves them out, 12 KB less to write to each of 1,000
    groups between a round's last ask and its last grant.
    """

    path: ClassVar[str] = "/quorum"
    step: int
    commit_failed: bool
    timeout_s: float
    round_step: int = 0
    quorum_id: int = 0
    finished: bool = False
    digest: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    known_quorum: int = 0
    config_digest: str = ""
    lane_failed: bool = False


@dataclass(frozen=True)
class RoundWatch(GroupMessage):
    """A long poll for the round other groups open past ``(step, round_step)`` (time-bounded windows).

    Answered ``{"round_step": r}`` as soon as an unfinished peer asks for a quorum at a later
    position (``QuorumBook.open_round``), or with 0 once ``timeout_s`` has passed.
    """

    path: ClassVar[str] = "/round_open"
    step: int
    round_step: int
    timeout_s: float


@dataclass(frozen=True)
class RecoveryNotice(GroupMessage):
    """The launcher's word that ``group`` died and is being replaced: rounds wait for its
    replacement up to ``wait_ms`` (0: go on without it at once, until it is back)."""

    path: ClassVar[str] = "/recovery"
    wait_ms: int


@dataclass(frozen=True)
class LaneWatch(GroupMessage):
    """A long poll of any worker of a group, held across its rounds: answered (``RoundNews``) as
    soon as members leave the last round the lighthouse granted the group (more than
    ``gone_seen`` of them where that is round ``round_id``, ``Quorum.round_id``, the worker's
    round), or with no news once ``timeout_s`` has passed. A round the group leaves by asking
    again answers nothing: one answer per group and round was half the writes of a round's
    burst at 1,000 groups."""

    path: ClassVar[str] = "/lane_watch"
    round_id: int
    timeout_s: float
    gone_seen: int = 0


@dataclass(frozen=True)
class RoundCommit(SignOfLife):
    """A group leader's ask to commit round ``round_id``, after which the group stands at
    committed ``step``: answered ``{"broken": ""}`` when it may (the step is recorded), else
    ``{"broken": why}`` and the group does not commit."""

    path: ClassVar[str] = "/commit"
    round_id: int
    step: int


ENDPOINTS: dict[str, type[GroupMessage]] = {
    m.path: m for m in (Heartbeat, QuorumAsk, RoundWatch, RecoveryNotice, LaneWatch, RoundCommit)
}


class RoundNews(NamedTuple):
    """The answer to a ``LaneWatch``, and to a ``RoundCommit`` (``broken``: why it is refused)."""

    round_id: int = 0  # the round the news is of
    broken: str = ""  # why the round broke; "" if it did not
    gone: tuple[str, ...] = ()  # the members that left it

    def to_json(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "broken": self.broken, "gone": list(self.gone)}

    @classmethod
    def from_json(cls, data: Any) -> RoundNews:
        """Raises ``ValueError`` unless ``data`` is such an answer."""
        if not isinstance(data, dict):
            raise ValueError(f"malformed round answer: {data!r:.200}")
        round_id, broken, gone = data.get("round_id"), data.get("broken"), data.get("gone")
        if not (
            isinstance(round_id, int)
            and not isinstance(round_id, bool)
            and isinstance(broken, str)
            and isinstance(gone, list)
            and all(isinstance(g, str) for g in gone)
        ):
            raise ValueError(f"malformed round answer: {data!r:.200}")
        return cls(round_id, broken, tuple(gone))


def round_open_from_json(data: Any) -> int:
    """Raises ``ValueError`` unless ``data`` is a ``RoundWatch`` answer; its round step (0: none)."""
    step = data.get("round_step") if isinstance(data, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"malformed round_open answer: {data!r:.200}")
    return step


def unreadable_post(path: str, content_length: str) -> ErrorAnswer | None:
    """Why a POST's body is not even read (unknown endpoint, no Content-Length, over the limit), or None."""
    if path not in ENDPOINTS:
        return ErrorAnswer(ErrorCode.NOT_FOUND, f"unknown path {path!r}: POST {' or '.join(ENDPOINTS)}")
    if not content_length.isdigit():
        return ErrorAnswer(ErrorCode.BAD_REQUEST, "a POST needs a Content-Length header")
    if int(content_length) > MAX_BODY_BYTES:
        return ErrorAnswer(
            ErrorCode.BAD_REQUEST, f"body of {content_length} bytes exceeds the limit of {MAX_BODY_BYTES}"
        )
    return None


def parse_request(path: str, body: bytes) -> GroupMessage:
    """The request to POST ``path`` (one of ``ENDPOINTS``); any problem is a 400 naming the field."""
    try:
        text = body.decode("utf-8")  # RFC 8259; and so no quote or bracket hides inside a multi-byte character
        # Nesting needs as many opening brackets, counted in C: the exact scan took a quorum ask 0.1 ms.
        opening = body.count(b"[") + body.count(b"{")
        if opening > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
            raise ValueError(f"nested {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise _bad_request(f"malformed JSON body: {e}") from None
    return ENDPOINTS[path].from_json(data)


# A string runs to its closing quote, or to the end as the parser reads an unclosed one: every match
# succeeds where it starts, so the scan never backtracks (a pattern requiring the closing quote took
# 10 s on 60 kB of unclosed strings).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_NESTING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of the UTF-8 JSON ``body`` nest, counted without parsing it
    (brackets inside strings do not count), so a body the parser would recurse too deep on is
    refused first; linear in the body, in C."""
    steps = _JSON_STRING.sub(b"", body).translate(_NESTING, delete=_NOT_A_BRACKET)
    return max(itertools.accumulate(memoryview(steps).cast("b")), default=0)


@functools.cache
def _schema(cls: type) -> tuple[dict[str, tuple[Callable[[Any], bool], str]], tuple[str, ...]]:
    """A message class's check and description by field, and its required fields, resolved once:
    resolving type hints and fields per request was most of a heartbeat's cost at the lighthouse
    (experiments/scale/lighthouse_scale.py)."""
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    checks = {f.name: _TYPES[get_origin(hints[f.name]) or hints[f.name]] for f in fields}
    required = tuple(
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return checks, required


def _bad_request(message: str) -> LighthouseRefused:
    return LighthouseRefused(ErrorCode.BAD_REQUEST, message)


def authorization_header(token: str) -> dict[str, str]:
    """The header a request carries the job's token in (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


_GIVE = f"give every part of the job the same cluster.lighthouse.token_file (or {TOKEN_ENV})"


def check_token(authorization: str | None, token: str) -> None:
    """Refuse (``BAD_TOKEN``) unless the Authorization header carries ``token``; an empty ``token`` requires none."""
    if not token:
        return
    given = authorization[len("Bearer ") :] if authorization and authorization.startswith("Bearer ") else ""
    if not given:
        raise LighthouseRefused(
            ErrorCode.BAD_TOKEN,
            f"missing token: this lighthouse requires the job's token ('Authorization: Bearer <token>'); {_GIVE}",
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise LighthouseRefused(
            ErrorCode.BAD_TOKEN,
            f"wrong token: the request's token does not match the lighthouse's; {_GIVE}",
        )


# -- quorum answers ------------------------------------------------------------------------
class QuorumGrant(NamedTuple):
    """A quorum containing the asking group, and the store its lanes rendezvous on."""

    quorum: Quorum
    store: tuple[str, int]

    def to_json(self, *, participants: bool = True) -> dict[str, Any]:
        """Without ``participants`` for an asker that holds them (``QuorumAsk.known_quorum``): only their number."""
        quorum = self.quorum.to_json()
        if not participants:  # nor their endpoints: an id names the same members, with the same endpoints
            quorum["members"] = len(quorum.pop("participants"))
            del quorum["endpoints"]
        return {"quorum": quorum, "store": {"host": self.store[0], "port": self.store[1]}}


def quorum_answer_to_json(answer: QuorumGrant | JobEnd) -> dict[str, Any]:
    """The 200 answer to a ``QuorumAsk``: a grant, or (to a finished group) the job's end."""
    return {"end": answer.to_json()} if isinstance(answer, JobEnd) else answer.to_json()


def quorum_answer_from_json(data: Any, held: Quorum | None = None) -> QuorumGrant | JobEnd:
    """Raises ``ValueError`` naming what is wrong unless ``data`` is a quorum answer.

    A grant without its participants takes them from ``held``, the quorum of that id the asker holds.
    """
    try:
        if "end" in data:
            return JobEnd.from_json(data["end"])
        store, quorum = data["store"], data["quorum"]
        if "participants" not in quorum:
            held_endpoints = held.endpoints if held is not None else {}
            quorum = {**quorum, "participants": _held_participants(quorum, held), "endpoints": held_endpoints}
        return QuorumGrant(Quorum.from_json(quorum), (str(store["host"]), int(store["port"])))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed quorum answer: {e!r}") from None


def _held_participants(quorum: dict[str, Any], held: Quorum | None) -> tuple[str, ...]:
    quorum_id, members = int(quorum["quorum_id"]), int(quorum["members"])
    if held is None or held.quorum_id != quorum_id or len(held.participants) != members:
        have = "none" if held is None else f"quorum {held.quorum_id} of {len(held.participants)}"
        raise ValueError(f"grant of quorum {quorum_id} of {members} without its participants; this group holds {have}")
    return held.participants
