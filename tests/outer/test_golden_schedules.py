"""Each round of a whole job, pinned: launch and apply steps, fragment, H, α and μ with the
warm-ups as the job runs them (tests/outer/golden_schedules.json). A change to the schedule, the
warm-ups or their cut to trainer.warmup_share moves these rounds, so it must be made on purpose."""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose_job
from tests.outer.regenerate_schedules import CASES, GOLDEN, REGENERATE, round_schedule


@pytest.mark.parametrize("name", list(CASES))
def test_a_jobs_rounds_are_the_checked_in_ones(name):
    golden = json.loads(GOLDEN.read_text(encoding="utf-8")).get(name, {})
    assert golden.get("overrides") == CASES[name], f"{name}: other overrides than checked in; run `{REGENERATE}`"
    now, was = round_schedule(compose_job(CASES[name])), golden["rounds"]
    moved = next((i for i, (a, b) in enumerate(zip(now, was)) if a != b), min(len(now), len(was)))
    assert now == was, (
        f"{name}: {len(now)} rounds, {len(was)} checked in; round {moved} is now "
        f"{now[moved] if moved < len(now) else None}, was {was[moved] if moved < len(was) else None}; "
        f"if on purpose, run `{REGENERATE}`"
    )
