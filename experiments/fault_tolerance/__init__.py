"""The fault tolerance experiments: their tables go to docs/results/fault-tolerance.md."""
