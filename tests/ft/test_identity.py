"""Which groups belong to a job: pure checks of job id, model signature and training configuration."""

from __future__ import annotations

import pytest

from diloco.config.job import training_config
from diloco.ft.identity import JobIdentity, NotThisJob, config_differences, config_digest
from tests.conftest import compose_job


def test_differences_name_each_key_with_both_values():
    job = {"algo.sync_every": 50, "algo.delay": 0, "model.dim": 64}
    group = {"algo.sync_every": 25, "model.dim": 64, "data.path": "/x"}
    assert config_differences(job, group) == [
        "algo.delay: job 0, this group (unset)",
        "algo.sync_every: job 50, this group 25",
        "data.path: job (unset), this group '/x'",
    ]
    assert config_differences(job, dict(job)) == []


def test_the_first_admitted_group_pins_what_the_launcher_left_open():
    identity = JobIdentity("job")
    with pytest.raises(NotThisJob, match="job id 'other' differs from this lighthouse's job 'job'"):
        identity.admit("other", "sig", {"a": 1})
    assert identity.signature is None and identity.config is None  # a refusal pins nothing
    identity.admit("job", "sig", {"a": 1})
    identity.admit("job", "sig", None)  # heartbeats carry no configuration
    with pytest.raises(NotThisJob, match="a: job 1, this group 2"):
        identity.admit("job", "sig", {"a": 2})
    with pytest.raises(NotThisJob, match="model signature other differs"):
        identity.admit("job", "other", {"a": 1})


def test_a_group_the_lighthouses_job_does_not_have_is_refused_before_it_pins_anything():
    """The lighthouse's own cluster.groups is pinned from the start: a group with an id past it, or
    counting other groups, never becomes the job's first group and trains alone."""
    identity = JobIdentity("job", groups=2)
    with pytest.raises(NotThisJob, match=r"group2 is not a group of this job: .*cluster.groups=2 \(group.id 0 to 1\)"):
        identity.admit("job", "sig", {"cluster.groups": 2, "a": 1}, group="group2")
    with pytest.raises(NotThisJob, match="cluster.groups: this lighthouse's job has 2, this group 3"):
        identity.admit("job", "sig", {"cluster.groups": 3, "a": 1}, group="group1")
    assert identity.signature is None and identity.config is None and identity.digest is None  # nothing pinned
    identity.admit("job", "sig", {"cluster.groups": 2, "a": 1}, group="group1")
    identity.admit("job", "sig", None, group="group0")  # a heartbeat: no configuration, a name in range
    identity.admit("job", "sig", None, group="a name of its own")  # a script's or a test's: no id to check
    JobIdentity("job").admit("job", "sig", {"cluster.groups": 3}, group="group7")  # count unknown: pinned by it


def test_a_granted_group_sends_its_configurations_digest_which_must_be_the_jobs():
    """A group sends its configuration in full until it is granted a quorum, then only
    its digest; a restarted lighthouse that has not seen it in full pins the digest."""
    config = {"algo.sync_every": 50, "inner_opt.betas": [0.9, 0.95]}
    digest = config_digest(config)
    assert digest == config_digest({"inner_opt.betas": (0.9, 0.95), "algo.sync_every": 50}), "as JSON sees it"
    assert digest != config_digest({**config, "algo.sync_every": 25})
    pinned = JobIdentity("job", config=config)
    pinned.admit("job", "sig", {}, digest)
    with pytest.raises(NotThisJob, match=r"configuration \(digest \w+\) differs from the job's"):
        pinned.admit("job", "sig", {}, config_digest({"algo.sync_every": 25}))
    restarted = JobIdentity("job")
    restarted.admit("job", "sig", {}, digest)  # the first ask it hears is a granted group's
    assert restarted.config is None and restarted.digest == digest
    with pytest.raises(NotThisJob, match="differs from the job's"):
        restarted.admit("job", "sig", {**config, "algo.sync_every": 25}, "")
    assert restarted.config is None, "a refusal pins nothing"
    restarted.admit("job", "sig", config, digest)  # a restarted group's first ask, in full
    assert restarted.config == config


def test_a_long_list_of_differences_is_cut_short():
    job = {f"k{i:02d}": i for i in range(20)}
    with pytest.raises(NotThisJob, match=r"in 20 key\(s\): .* \(and 12 more\)"):
        JobIdentity("job", config=job).admit("job", "sig", {k: -1 for k in job})


def test_the_training_config_holds_what_groups_must_share_and_nothing_per_group():
    one = training_config(compose_job(["cluster.groups=3", "group.id=0"]))
    assert one == training_config(compose_job(["cluster.groups=3", "group.id=2", "logger=none", "faults=chaos"]))
    other = training_config(compose_job(["cluster.groups=3", "algo.sync_every=25", "trainer.max_steps=500"]))
    assert config_differences(one, other) == ["algo.sync_every: job 50, this group 25"]
    assert one["inner_opt.betas"] == [0.9, 0.95]  # JSON-friendly: what the lighthouse receives compares equal
    staged = training_config(compose_job(["cluster.groups=3", "parallel.pp=2", "parallel.pp_split=[1,1]"]))
    assert config_differences(one, staged) == [
        "parallel.pp: job 1, this group 2",
        "parallel.pp_split: job [], this group [1, 1]",
    ], "groups of other meshes are refused: their lanes would reduce other stages' parameters"
