"""The outer warm-ups cut to ``trainer.warmup_share`` of the job (diloco/config/warmups.py)."""

import pytest

from diloco.config.base import ConfigError
from diloco.config.job import job_config_from_dict
from diloco.config.warmups import planned_windows, scheduled, warmup_line


def job(max_steps=500, share=0.2, **algo):
    return job_config_from_dict({"trainer": {"max_steps": max_steps, "warmup_share": share}, "algo": algo})


def test_the_default_job_warms_up_over_its_first_fifth():
    algo, outer_opt = scheduled(job())
    assert algo.sync_warmup_window() == (10, 100), "10-step windows up to step 100, then H=50"
    assert (algo.alpha_warmup_steps, outer_opt.momentum_warmup_steps) == (100, 100)
    assert planned_windows(job()) == 10 + 8


@pytest.mark.parametrize(("h", "windows"), [(10, 6), (20, 3), (30, 2), (60, 1)])
def test_in_a_short_job_every_h_gives_its_own_rounds(h, windows):
    """60 steps: the 500-step sync warm-up at full length would make every H sync every 10 steps."""
    assert planned_windows(job(60, sync_every=h)) == windows
    assert scheduled(job(60, sync_every=h))[0].sync_warmup_window() is None


@pytest.mark.parametrize("max_steps", [5000, 10_000])
def test_a_long_job_keeps_every_warm_up_as_configured(max_steps):
    algo, outer_opt = scheduled(job(max_steps))
    assert algo.sync_warmup_window() == (10, 500)
    assert (algo.alpha_warmup_steps, outer_opt.momentum_warmup_steps) == (1000, 500)
    assert "cut" not in warmup_line(job(max_steps))


@pytest.mark.parametrize(
    ("max_steps", "h", "share"), [(500, 50, 0.2), (600, 100, 0.3), (1000, 20, 0.15), (400, 40, 0.99)]
)
def test_a_cut_sync_warm_up_ends_on_a_whole_h_window_within_the_share(max_steps, h, share):
    algo, _ = scheduled(job(max_steps, share, sync_every=h))
    warm = algo.sync_warmup_steps
    assert warm % h == 0 and warm <= max(share * max_steps, 0)
    configured = -(-500 // h) * h
    assert warm == min(configured, int(share * max_steps) // h * h)


def test_share_one_runs_every_warm_up_as_configured_as_before():
    algo, outer_opt = scheduled(job(500, 1))
    assert algo.sync_warmup_window() == (10, 500)
    assert (algo.alpha_warmup_steps, outer_opt.momentum_warmup_steps) == (1000, 500)
    assert planned_windows(job(500, 1)) == 50
    assert planned_windows(job(60, 1, sync_every=20)) == 6, "a warm-up as configured may outlast the job"


def test_the_start_line_says_each_warm_up_what_was_cut_and_the_keys():
    line = warmup_line(job())
    assert line == (
        "warm-up: outer rounds every 10 steps until step 100, then every 50; the mixing weight α rising from 0 "
        "to 0.5 over 100 steps; the outer momentum rising from 0 to 0.9 over 100 steps (algo.sync_warmup_steps=500 "
        "cut to 100, algo.alpha_warmup_steps=1000 cut to 100, outer_opt.momentum_warmup_steps=500 cut to 100; each "
        "at most trainer.warmup_share=20% of the 500 steps; a key =0 turns its warm-up off)"
    )
    short = warmup_line(job(60, sync_every=20))
    assert "no short windows at the start (too few steps for one)" in short
    assert "(algo.sync_warmup_steps=500 cut to 0, " in short


def test_no_line_without_warm_ups_or_outer_rounds():
    assert warmup_line(job_config_from_dict({"algo": {"name": "ddp", "sync_every": 1}})) is None
    none = {"algo": {"sync_warmup_steps": 0, "alpha_warmup_steps": 0}, "outer_opt": {"momentum_warmup_steps": 0}}
    assert warmup_line(job_config_from_dict(none)) is None


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_the_share_must_be_a_fraction(share):
    with pytest.raises(ConfigError, match=r"trainer.warmup_share=.*must be in \[0, 1\]"):
        job(share=share)
