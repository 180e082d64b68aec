"""The lighthouse's wire protocol: each endpoint's fields and types, and the errors clients see.

Plain HTTP + JSON, shared by the server (lighthouse.py) and its clients (client.py); nothing
received is ever unpickled (DESIGN.md invariant 5). Every request is checked field by field,
and a problem is a 400 that names the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_BODY_BYTES = 64 * 1024
MAX_GROUP_ID_CHARS = 200
MAX_CONFIG_KEYS = 1000

# Body fields of each POST endpoint beyond job/signature/group: name -> (type, default or
# None when required). A quorum request may carry the last quorum id the group saw, so a
# restarted lighthouse never reuses an id even if a request reaches it before any heartbeat,
# and the inner step the group asks at (QuorumRequest.round_step); it carries the group's
# flat training configuration, which must match the job's.
FIELDS: dict[str, dict[str, tuple[type, Any]]] = {
    "/heartbeat": {"step": (int, None), "quorum_id": (int, None), "finished": (bool, False)},
    "/quorum": {
        "step": (int, None),
        "round_step": (int, 0),
        "commit_failed": (bool, None),
        "timeout_s": (float, None),
        "quorum_id": (int, 0),
        "finished": (bool, False),
        "digest": (str, ""),
        "config": (dict, {}),
    },
}


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


class LighthouseRefused(RuntimeError):
    """The lighthouse refused the request (token, job id, model signature, malformed request):
    the same request will be refused again, so fix the configuration instead of retrying.
    The lighthouse raises it internally too; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LighthouseUnavailable(RuntimeError):
    """The lighthouse could not be reached or failed (connection refused/reset, timeout, 5xx)."""


class QuorumTimeout(RuntimeError):
    """No quorum containing this group formed within the requested time; the request is withdrawn."""


def parse_body(path: str, body: bytes) -> dict[str, Any]:
    """The request's fields, type-checked; any problem is a 400 naming the field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise LighthouseRefused(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise LighthouseRefused(400, f"the body must be a JSON object, got {type(data).__name__}")
    spec = {"job": (str, None), "signature": (str, None), "group": (str, None), **FIELDS[path]}
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise LighthouseRefused(400, f"unknown field {unknown[0]!r} for {path}; expected {sorted(spec)}")
    req = {}
    for name, (tp, default) in spec.items():
        if name not in data:
            if default is None:
                raise LighthouseRefused(400, f"missing field {name!r} for {path}; expected {sorted(spec)}")
            req[name] = default
            continue
        req[name] = value = data[name]
        ok, what = _TYPES[tp]
        if not ok(value):
            raise LighthouseRefused(400, f"field {name!r}={value!r} must be {what}")
    if not 0 < len(req["group"]) <= MAX_GROUP_ID_CHARS:
        raise LighthouseRefused(
            400, f"field 'group' must be 1 to {MAX_GROUP_ID_CHARS} characters, got {len(req['group'])}"
        )
    return req
