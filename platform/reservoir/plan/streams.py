"""What a run's stream pipelines (its config's `pipelines`) mean for the rows explorers write."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

from reservoir.yamlfile import read_yaml


@functools.lru_cache(maxsize=64)
def _reads_experiences(path: str) -> bool:
    raw, _ = read_yaml(path, "pipeline")
    source = raw.get("source") if isinstance(raw, dict) else None
    return not (isinstance(source, dict) and source.get("table") == "tasks")


def written_status(pipelines: Sequence[Path | str]) -> str:
    """The status explorers write rows in: raw while a stream pipeline over experiences gates
    them (only rows it passes become ready), else ready (pipelines over tasks leave experiences
    as they are)."""
    return "raw" if any(_reads_experiences(str(path)) for path in pipelines) else "ready"
