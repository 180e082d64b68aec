"""The parallelism experiments: their tables go to docs/results/parallelism.md."""
