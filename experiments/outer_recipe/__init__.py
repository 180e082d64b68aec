"""The outer recipe experiments: their tables go to docs/results/outer-recipe.md."""
