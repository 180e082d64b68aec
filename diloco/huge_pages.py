"""Transparent huge pages for torch's large CPU allocations, by default in the job's processes.

With THP_MEM_ALLOC_ENABLE set, torch aligns each CPU allocation of 2 MB or more to 2 MB and asks the
kernel for huge pages there (madvise), so a first touch faults once a 2 MB page instead of once a
4 KB one. A restarted worker's state and a heal's staging are gigabytes of pages it never touched:
at 150M a heal's transfer into fresh pages took 1.2-1.7 s with it, 6.6-7.1 s without, beside a bare
send of the same bytes of 0.6-1.0 s (docs/results/scale.md, "What grows with the model").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
KERNEL_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"


def huge_pages_by_default() -> None:
    """Set it unless the user did (``THP_MEM_ALLOC_ENABLE=0`` turns it off). torch reads it once, at its
    first allocation, so this runs before torch is imported; every process started from here inherits it."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def huge_pages_line(environ: Mapping[str, str] = os.environ, kernel_setting: Path = KERNEL_SETTING) -> str | None:
    """The job header's line saying torch's large CPU allocations ask for huge pages; None when they do not.
    It says too when the kernel grants none (its setting ``never``), so a slow first touch is not a mystery."""
    if environ.get(HUGE_PAGES_ENV) != "1":
        return None
    line = "memory: torch's CPU allocations of 2 MB or more ask for transparent huge pages"
    line += f" ({HUGE_PAGES_ENV}=1; =0 turns it off)"
    try:
        chosen = next(w for w in kernel_setting.read_text().split() if w.startswith("["))
    except (OSError, StopIteration):
        return line  # no such setting here: nothing to add
    return f"{line}, but the kernel grants none ({kernel_setting}: never)" if chosen == "[never]" else line
