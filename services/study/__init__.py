"""Studies: a grid of runs judged by statistics (docs/studies.md)."""
