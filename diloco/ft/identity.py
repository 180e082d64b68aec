"""Which groups belong to a job: its id, its model signature and its training configuration.

A lighthouse serves one job. What the launcher did not pin when it started the lighthouse,
the first accepted group pins (the model signature, the training configuration); a later
group that differs is refused with what differs. Two groups with different settings could
otherwise train "one" model that each holds differently, and both would report success.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.config.cluster import group_id

MAX_DIFFERENCES_SHOWN = 8
_UNSET = object()


class NotThisJob(ValueError):
    """A group that does not belong to the lighthouse's job; the message says what differs."""


def config_differences(job: Mapping[str, Any], group: Mapping[str, Any]) -> list[str]:
    """``key: job X, this group Y`` for every flat key whose value differs, sorted by key."""
    lines = []
    for key in sorted(set(job) | set(group)):
        ours, theirs = job.get(key, _UNSET), group.get(key, _UNSET)
        if ours != theirs:
            shown = ["(unset)" if v is _UNSET else repr(v) for v in (ours, theirs)]
            lines.append(f"{key}: job {shown[0]}, this group {shown[1]}")
    return lines


def config_digest(config: Mapping[str, Any]) -> str:
    """The digest a group sends instead of its configuration once it was granted a quorum: the same
    for equal configurations on both sides of the JSON wire (keys sorted, lists and tuples alike)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


@dataclass
class JobIdentity:
    """The job a lighthouse serves; ``None`` fields are pinned by the first group admitted.

    The configuration is pinned in full by a group's first ask, or by its digest alone when the
    first ask a (restarted) lighthouse hears is one of a group that had been granted a quorum.
    ``groups``: the lighthouse's own ``cluster.groups`` (0: unknown), which no group pins: a group
    ``group<id>`` whose id is not below it, or whose configuration counts other groups, is refused,
    so a group the job does not have never trains alone in it.
    """

    job_id: str
    signature: str | None = None
    config: dict[str, Any] | None = None
    groups: int = 0
    digest: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.config is not None:
            self.digest = config_digest(self.config)

    def admit(
        self, job: str, signature: str, config: Mapping[str, Any] | None, digest: str = "", group: str = ""
    ) -> None:
        """Raise ``NotThisJob`` unless the group belongs to this job; pins what is still open.

        ``config`` is the group's training configuration in full, or (empty) ``digest`` stands for it;
        ``group`` its name (``group<id>``).
        """
        if job != self.job_id:
            raise NotThisJob(
                f"job id {job!r} differs from this lighthouse's job {self.job_id!r}: the group belongs to "
                "another job (each job needs its own lighthouse and its own name)"
            )
        if self.signature is not None and signature != self.signature:
            raise NotThisJob(
                f"model signature {signature} differs from the job's {self.signature}: "
                "the group's model differs (its config, or its parameters' names, shapes or dtypes)"
            )
        if (
            config
            and self.config is not None
            and config != self.config
            and (differences := config_differences(self.config, config))
        ):
            shown = "; ".join(differences[:MAX_DIFFERENCES_SHOWN])
            more = len(differences) - MAX_DIFFERENCES_SHOWN
            raise NotThisJob(
                f"the group's training configuration differs from the job's in {len(differences)} key(s): {shown}"
                + (f" (and {more} more)" if more > 0 else "")
                + "; every group of a job must run the same configuration"
            )
        self._check_count(group, config)  # before anything is pinned: a refusal changes nothing
        if (config and self.config is None) or (digest and not config):  # else the keys compared above
            digest = config_digest(config) if config else digest
            if self.digest is not None and digest != self.digest:
                raise NotThisJob(
                    f"the group's training configuration (digest {digest}) differs from the job's ({self.digest}); "
                    "every group of a job must run the same configuration"
                )
            self.digest = digest
        self.signature = signature
        if config and self.config is None:
            self.config = dict(config)

    def _check_count(self, group: str, config: Mapping[str, Any] | None) -> None:
        if not self.groups:
            return
        theirs = (config or {}).get("cluster.groups", self.groups)
        if theirs != self.groups:
            raise NotThisJob(
                f"cluster.groups: this lighthouse's job has {self.groups}, this group {theirs!r}; start the "
                "lighthouse and every group with the same cluster.groups"
            )
        named = group_id(group)  # a name of one's own (a test's, a script's) has no id to check
        if named is not None and named >= self.groups:
            raise NotThisJob(
                f"{group} is not a group of this job: its lighthouse has cluster.groups={self.groups} "
                f"(group.id 0 to {self.groups - 1}); check group.id, or start the lighthouse with the job's cluster.groups"
            )
