"""Benchmark and reproduction scripts, by docs/results/ page: python -m experiments.<area>.<script>."""

from diloco.huge_pages import huge_pages_by_default

huge_pages_by_default()  # as run.py does: the jobs measured here run as a user's would
