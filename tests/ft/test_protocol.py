"""The wire protocol without a server: messages, their strict parsing, error codes and answers."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from diloco.ft.client import LighthouseClient
from diloco.ft.protocol import (
    ENDPOINTS,
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    ErrorAnswer,
    ErrorCode,
    GroupProgress,
    Heartbeat,
    LaneWatch,
    LighthouseRefused,
    LighthouseUnavailable,
    QuorumAsk,
    QuorumGrant,
    QuorumSuperseded,
    QuorumTimeout,
    ReachReport,
    RecoveryNotice,
    RoundCommit,
    RoundNews,
    RoundWatch,
    authorization_header,
    check_token,
    json_depth,
    parse_request,
    quorum_answer_from_json,
    quorum_answer_to_json,
    round_open_from_json,
    unreadable_post,
)
from diloco.ft.quorum import JobEnd, Quorum

WHO = {"job": "job-1", "signature": "sig", "group": "A"}


def test_the_field_names_on_the_wire_are_fixed():
    """Clients and lighthouses of one release talk JSON with exactly these keys."""
    progress = GroupProgress(
        inner_step=40, train_loss=2.5, tokens_per_s=1000.0, digest="ab12", eval_loss=2.75, eval_step=30
    )
    reach = {"port": 4567, "reached": {"B": "10.0.0.2:4000"}, "unreached": {"C": "10.0.0.3:4000"}, "mbps": {"B": 9.5}}
    beat = Heartbeat(**WHO, step=3, quorum_id=2, progress=progress.to_json(), reach=reach)
    assert beat.to_json() == {
        **WHO,
        "step": 3,
        "quorum_id": 2,
        "finished": False,
        "progress": {
            "inner_step": 40,
            "train_loss": 2.5,
            "tokens_per_s": 1000.0,
            "digest": "ab12",
            "eval_loss": 2.75,
            "eval_step": 30,
        },
        "reach": reach,
    }
    assert beat.reach_report == ReachReport(4567, {"B": "10.0.0.2:4000"}, {"C": "10.0.0.3:4000"}, {"B": 9.5})
    assert GroupProgress.from_json(beat.progress) == progress
    assert beat.group_progress == progress, "parsed once, when the message is made, and kept off the wire"
    assert GroupProgress().to_json() == {"inner_step": 0}, "unknown numbers are left out, not sent as null"
    ask = QuorumAsk(**WHO, step=3, commit_failed=True, timeout_s=1.5, config={"algo.name": "diloco"})
    assert ask.to_json() == {
        **WHO,
        "progress": {},
        "reach": {},
        "step": 3,
        "commit_failed": True,
        "timeout_s": 1.5,
        "round_step": 0,
        "quorum_id": 0,
        "finished": False,
        "digest": "",
        "config": {"algo.name": "diloco"},
        "known_quorum": 0,
        "config_digest": "",
        "lane_failed": False,
    }
    watch = RoundWatch(**WHO, step=3, round_step=40, timeout_s=2.0)
    assert watch.to_json() == {**WHO, "step": 3, "round_step": 40, "timeout_s": 2.0}
    notice = RecoveryNotice(**WHO, wait_ms=1500)
    assert notice.to_json() == {**WHO, "wait_ms": 1500}
    lane_watch = LaneWatch(**WHO, round_id=7, timeout_s=60.0, gone_seen=1)
    assert lane_watch.to_json() == {**WHO, "round_id": 7, "timeout_s": 60.0, "gone_seen": 1}
    commit = RoundCommit(**WHO, round_id=7, step=4, progress={"inner_step": 41})
    assert commit.to_json() == {**WHO, "round_id": 7, "step": 4, "progress": {"inner_step": 41}, "reach": {}}
    assert commit.group_progress == GroupProgress(inner_step=41), "every sign of life reports progress"
    assert sorted(ENDPOINTS) == ["/commit", "/heartbeat", "/lane_watch", "/quorum", "/recovery", "/round_open"]
    for message in (beat, ask, watch, notice, lane_watch, commit):
        assert parse_request(message.path, json.dumps(message.to_json()).encode()) == message


def test_a_round_answer_is_checked():
    news = RoundNews(3, "group g1 left round 3", ("g1",))
    assert news.to_json() == {"round_id": 3, "broken": "group g1 left round 3", "gone": ["g1"]}
    assert RoundNews.from_json(news.to_json()) == news
    bad_answers = (
        {},
        {"round_id": True, "broken": "", "gone": []},
        {"round_id": 3, "broken": "", "gone": [3]},
        {"broken": "", "gone": []},
        ["", True],
        None,
    )
    for bad in bad_answers:
        with pytest.raises(ValueError, match="malformed round answer"):
            RoundNews.from_json(bad)


def test_a_round_open_answer_is_checked():
    assert round_open_from_json({"round_step": 40}) == 40
    assert round_open_from_json({"round_step": 0}) == 0
    for bad in ({}, {"round_step": -1}, {"round_step": True}, {"round_step": "40"}, [40], None):
        with pytest.raises(ValueError, match="malformed round_open answer"):
            round_open_from_json(bad)


ASK = {"step": 1, "commit_failed": False, "timeout_s": 1}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1]", "the body must be a JSON object, got list"),
        (json.dumps({**WHO, "step": 1}).encode(), "missing field 'commit_failed' for /quorum"),
        (json.dumps({**WHO, "step": 1, "commit_failed": 0, "timeout_s": 1}).encode(), "'commit_failed'=0 must be true"),
        (json.dumps({**WHO, "step": -1, "commit_failed": False, "timeout_s": 1}).encode(), "'step'=-1 must be a non-"),
        (json.dumps({**WHO, "step": 1, "commit_failed": False, "timeout_s": 0}).encode(), "'timeout_s'=0 must be a po"),
        (json.dumps({**WHO, "step": 1, "commit_failed": False, "timeout_s": 1, "x": 1}).encode(), "unknown field 'x'"),
        (json.dumps({**WHO, "step": 1, "commit_failed": False, "timeout_s": 1, "config": [1]}).encode(), "'config'"),
        (json.dumps({**WHO, "group": "g" * 201, "step": 1, "commit_failed": False, "timeout_s": 1}).encode(), "1 to"),
        (json.dumps({**WHO, **ASK, "reach": {"port": 70000}}).encode(), "reach field 'port'=70000 must be a TCP port"),
        (json.dumps({**WHO, **ASK, "reach": {"reached": ["B"]}}).encode(), "reach field 'reached' must map"),
        (json.dumps({**WHO, **ASK, "reach": {"unreached": {"B": 1}}}).encode(), "'unreached' must map .* endpoints"),
        (json.dumps({**WHO, **ASK, "reach": {"mbps": {"B": -1}}}).encode(), "'mbps' must map .* positive rates"),
        (json.dumps({**WHO, **ASK, "reach": {"host": "x"}}).encode(), "unknown reach field 'host'"),
    ],
)
def test_a_malformed_request_is_a_bad_request_naming_the_field(body, message):
    with pytest.raises(LighthouseRefused, match=message) as refused:
        parse_request("/quorum", body)
    assert refused.value.code is ErrorCode.BAD_REQUEST and refused.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 30_000,  # json.loads raised RecursionError on it, under MAX_BODY_BYTES
        b'{"a":' * 12_000,
        b'[{"a":' * 10_000,
        b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),  # well-formed, one level too deep
        b'{"job": "x", "pad": ' + b"[" * 30_000,
    ],
    ids=["brackets", "objects", "mixed", "one too deep", "deep after a string"],
)
def test_a_body_nested_too_deep_is_a_bad_request_before_it_is_parsed(body):
    assert len(body) <= MAX_BODY_BYTES
    with pytest.raises(
        LighthouseRefused, match=f"nested .* levels deep, over the limit of {MAX_JSON_DEPTH}"
    ) as refused:
        parse_request("/heartbeat", body)
    assert refused.value.status == 400 and "\n" not in str(refused.value)


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b"") == json_depth(b"1") == 0
    assert json_depth(json.dumps({**WHO, "config": {"inner_opt.betas": [0.9, 0.95]}}).encode()) == 3
    assert json_depth(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) == MAX_JSON_DEPTH
    assert json_depth(json.dumps({"a": "[[[{{{" * 100}).encode()) == 1  # brackets in a string
    assert json_depth(json.dumps({"a": '\\"[[[' + '"'}).encode()) == 1  # escaped quotes and backslashes
    assert json_depth(b'["unclosed [[[[[[[') == 1  # the parser reads an unclosed string to the end too
    assert json_depth('["\u00e9[", "\u2200"]'.encode()) == 1


def test_a_body_at_the_depth_limit_is_parsed_and_one_not_utf8_is_refused():
    """The limit refuses nothing a group sends; a non-UTF-8 body (which could hide a quote from the depth
    count inside a multi-byte character) is malformed."""
    nested = json.dumps({**WHO, "step": 1, "quorum_id": 0, "pad": [[[]]]}).encode()
    with pytest.raises(LighthouseRefused, match="unknown field 'pad'"):  # parsed, refused for its field
        parse_request("/heartbeat", nested)
    with pytest.raises(LighthouseRefused, match="malformed JSON body: 'utf-8' codec"):
        parse_request("/heartbeat", json.dumps(WHO).encode("utf-16"))


def test_the_depth_count_never_backtracks():
    """A body of unclosed strings once took the string pattern 10 s (every start scanned to the end):
    the count is linear. Asserted on the answer, not the time: a quadratic scan would hang the suite."""
    for body in (b'"\\' * 30_000, b'"' * 60_000, b'"' + b"\\\\" * 15_000, b'"' + b"[" * 60_000):
        assert json_depth(body) <= 1


def test_a_post_that_cannot_be_read_is_answered_before_its_body():
    assert unreadable_post("/quorum", "12") is None
    assert unreadable_post("/nope", "12").code is ErrorCode.NOT_FOUND
    assert unreadable_post("/quorum", "").code is ErrorCode.BAD_REQUEST
    too_big = unreadable_post("/heartbeat", str(MAX_BODY_BYTES + 1))
    assert too_big.status == 400 and "exceeds the limit" in too_big.error


def test_every_code_has_a_status_and_a_client_exception():
    expected = {
        ErrorCode.BAD_REQUEST: (400, LighthouseRefused),
        ErrorCode.NOT_FOUND: (404, LighthouseRefused),
        ErrorCode.BAD_TOKEN: (401, LighthouseRefused),
        ErrorCode.WRONG_JOB: (409, LighthouseRefused),
        ErrorCode.JOB_ENDED: (409, LighthouseRefused),
        ErrorCode.SUPERSEDED: (409, QuorumSuperseded),
        ErrorCode.TIMEOUT: (504, QuorumTimeout),
        ErrorCode.WITHDRAWN: (504, QuorumTimeout),
        ErrorCode.STOPPING: (503, LighthouseUnavailable),
    }
    assert set(expected) == set(ErrorCode)
    for code, (status, exception) in expected.items():
        answer = ErrorAnswer(code, f"reason for {code.value}")
        assert answer.status == status
        assert ErrorAnswer.from_json(json.loads(json.dumps(answer.to_json()))) == answer
        error = answer.exception()
        assert type(error) is exception and str(error) == answer.error
        assert getattr(error, "code", code) is code
    assert not issubclass(QuorumSuperseded, LighthouseRefused), "a superseded request is not a refusal to act on"


@pytest.mark.parametrize("data", [{"error": "no code"}, {"error": "x", "code": "gone"}, {"code": "timeout"}, [1]])
def test_an_error_answer_without_a_known_code_is_not_one(data):
    with pytest.raises(ValueError):
        ErrorAnswer.from_json(data)


def test_quorum_answers_round_trip_and_malformed_ones_are_named():
    grant = QuorumGrant(Quorum(3, ("A", "B"), 7, {"B": "A"}), ("10.0.0.1", 29500))
    end = JobEnd(round=9, digest="d9", holders=("A", "B"))
    for answer in (grant, end):
        assert quorum_answer_from_json(json.loads(json.dumps(quorum_answer_to_json(answer)))) == answer
    assert quorum_answer_to_json(grant)["store"] == {"host": "10.0.0.1", "port": 29500}
    for bad in ({}, {"quorum": {"quorum_id": 1}}, {"end": {"round": "x"}}, {"quorum": [], "store": None}):
        with pytest.raises(ValueError, match="malformed quorum answer"):
            quorum_answer_from_json(bad)


def test_a_grant_without_participants_takes_those_of_the_quorum_the_group_holds():
    held = Quorum(3, ("A", "B"), 7, {})
    grant = QuorumGrant(Quorum(3, ("A", "B"), 8, {}, round_id=5), ("10.0.0.1", 29500))
    compact = json.loads(json.dumps(grant.to_json(participants=False)))
    assert "participants" not in compact["quorum"] and compact["quorum"]["members"] == 2
    assert quorum_answer_from_json(compact, held) == grant
    for other in (None, Quorum(2, ("A", "B"), 7, {}), Quorum(3, ("A",), 7, {})):
        with pytest.raises(ValueError, match="without its participants"):
            quorum_answer_from_json(compact, other)


def test_the_token_travels_as_a_bearer_header():
    assert authorization_header("") == {}
    check_token(authorization_header("s3cret")["Authorization"], "s3cret")
    check_token(None, "")  # no token configured: none required
    for header, reason in ((None, "missing token"), ("Bearer guess", "wrong token"), ("s3cret", "missing token")):
        with pytest.raises(LighthouseRefused, match=reason) as refused:
            check_token(header, "s3cret")
        assert refused.value.code is ErrorCode.BAD_TOKEN


def test_a_4xx_without_a_code_is_refused_as_not_the_lighthouse():
    """A 4xx from some other server on the port will answer the same to every retry: the group
    stops with a message naming the address, as it did before error codes existed."""

    class NotALighthouse(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotALighthouse)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = LighthouseClient(url, token="", job_id="job-1", signature="sig", group="A", connect_timeout_s=2.0)
        with pytest.raises(LighthouseRefused, match="HTTP 404 .* without a lighthouse error code.*at this address"):
            client.heartbeat(0, 0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)


@pytest.mark.parametrize(
    ("progress", "message"),
    [
        ({"inner_step": -1}, "progress field 'inner_step'=-1 must be a non-negative integer"),
        ({"train_loss": "low"}, "progress field 'train_loss'='low' must be a finite non-negative number"),
        ({"tokens_per_s": True}, "progress field 'tokens_per_s'=True must be a finite"),
        ({"digest": "f" * 65}, "progress field 'digest' must be a string of at most 64"),
        ({"loss": 1.0}, "unknown progress field 'loss'"),
        ({"inner_step": None}, "progress field 'inner_step'=None must be a non-negative integer"),
        ({"eval_loss": -0.5, "eval_step": 3}, "progress field 'eval_loss'=-0.5 must be a finite non-negative number"),
        ({"eval_loss": 2.0, "eval_step": 1.5}, "progress field 'eval_step'=1.5 must be a non-negative integer"),
        ({"eval_loss": 2.0, "eval_step": False}, "progress field 'eval_step'=False must be a non-negative integer"),
        ({"eval_loss": 2.0}, "progress fields 'eval_loss' and 'eval_step' come together or not at all"),
        ({"eval_step": 3}, "progress fields 'eval_loss' and 'eval_step' come together or not at all"),
    ],
)
def test_a_heartbeat_with_malformed_progress_is_refused_naming_the_field(progress, message):
    body = json.dumps({**WHO, "step": 1, "quorum_id": 0, "progress": progress}).encode()
    with pytest.raises(LighthouseRefused, match=re.escape(message)) as refused:
        parse_request("/heartbeat", body)
    assert refused.value.status == 400
