"""Pipelines: operator YAML, the Data-Juicer bridge, validation, the runner and the scheduler."""
