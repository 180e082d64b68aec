"""The scale experiments: their tables go to docs/results/scale.md."""
