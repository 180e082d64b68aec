"""The communication experiments: their tables go to docs/results/communication.md."""
