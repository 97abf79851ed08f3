"""Small helpers the operators share."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value) -> float | None:
    """A reward as a float, None if missing or NaN."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def loads(value) -> dict[str, Any]:
    """A JSON field (reward_components, metadata) as a dict; a dict passes through."""
    if isinstance(value, dict):
        return value
    return json.loads(value) if value else {}


def dumps(value: dict[str, Any]) -> str:
    return json.dumps(value)


def group_rows(group_ids) -> dict[Any, list[int]]:
    """Row indexes of each group, in order."""
    groups: dict[Any, list[int]] = {}
    for index, group in enumerate(group_ids):
        groups.setdefault(group, []).append(index)
    return groups


WHOLE = 10 ** 9  # batch_size for group operators: one batch, so no group is split
