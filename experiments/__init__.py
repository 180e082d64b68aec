"""Benchmark and reproduction scripts, by docs/results/ page: python -m experiments.<area>.<script>."""
