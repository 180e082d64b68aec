"""The job's secrets, and the one function that hides them before a config leaves the process.

A config is logged, printed, saved as a run's ``config.yaml`` and handed to wandb (whose
files, ``debug.log`` and ``run-*.wandb``, others may read, and which an online run sends to
a server): every such copy goes through ``redacted`` (docs/design.md, invariant 8). Only the
local job's ``job.json`` (0600), which its workers read the token from, holds it in full.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# Where a secret sits in a job's config: (section, ..., key).
SECRET_KEYS = (("cluster", "lighthouse", "token"),)
REDACTED = "<redacted>"
# Where a multi-host role reads the job's token when ``cluster.lighthouse.token_file`` is not set.
TOKEN_ENV = "DILOCO_LIGHTHOUSE_TOKEN"


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of the plain config dict ``config`` with every set secret replaced by ``<redacted>``
    (an empty one stays empty: it says no token was set)."""
    out = copy.deepcopy(dict(config))
    for *sections, key in SECRET_KEYS:
        node: Any = out
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(key):
            node[key] = REDACTED
    return out
