"""absl entry points: `python -m experiments.train`, `python -m experiments.benchmark`."""
