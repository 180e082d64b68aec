"""The gpu experiments: their tables go to docs/results/gpu.md."""
