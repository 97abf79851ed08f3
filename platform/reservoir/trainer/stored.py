"""A stage's stored data: the experiences of earlier runs (or this one) it reads, in order.

The rows are read once when the stage starts, through the pipelines' `where` machinery (the
engineer's expression runs alone, read-only, returning ids; a second statement reads only the
named runs in the named statuses), grouped, ordered and, with `select: best`, cut to each
group's highest-reward response. Step k of the stage takes the next `batch` groups, cycling
through them epoch after epoch; nothing is leased (history is read, not consumed) and the
ledger records every row each step used, whichever run wrote it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from reservoir.config import StoredData
from reservoir.errors import ConfigError
from reservoir.store import TRAINABLE_STATUSES, Source, select_rows
from reservoir.errors import UserSQLError


@dataclass(frozen=True)
class StoredGroups:
    groups: tuple[tuple[int, ...], ...]   # experience ids, group by group

    def step_ids(self, step_in_stage: int, batch: int) -> list[int]:
        """Ids of the stage's `step_in_stage`-th step (1-based), in id order."""
        start = (step_in_stage - 1) * batch
        picked = [self.groups[(start + i) % len(self.groups)] for i in range(batch)]
        return sorted({row for group in picked for row in group})


def read_stored(url: str, run_ids: list[int], data: StoredData, *, stage: str, seed: int,
                until: dict | None = None) -> StoredGroups:
    """The stage's groups; `until` maps a run id to the time after which its rows are not
    read (a branched run reads its parent's rows as they were at the branch step)."""
    try:
        rows = select_rows(url, Source(run_ids=run_ids, statuses=data.status, where=data.where,
                                       order_by=("group_id", "id")),
                           who=f"stage {stage!r}", allowed=TRAINABLE_STATUSES)
    except UserSQLError as exc:  # named by the stage's key, not a pipeline's
        raise UserSQLError(f"stages.{stage}.data.stored."
                           f"{str(exc).removeprefix('source.')}") from None
    groups: dict = {}
    for row in rows:
        if until and row["run_id"] in until and row["created_at"] > until[row["run_id"]]:
            continue
        groups.setdefault(row["group_id"], []).append(row)
    if not groups:
        raise ConfigError(f"stages.{stage}.data.stored: no experiences match (runs, status, "
                          "where)")
    ordered = list(groups.values())
    if data.order == "reward":
        ordered.sort(key=lambda group: -max(_reward(row) for row in group))
    elif data.order == "random":
        random.Random(f"{seed}:{stage}").shuffle(ordered)
    else:
        ordered.sort(key=lambda group: min(row["id"] for row in group))
    if data.select == "best":
        return StoredGroups(tuple((max(group, key=_reward)["id"],) for group in ordered))
    return StoredGroups(tuple(tuple(row["id"] for row in group) for group in ordered))


def _reward(row: dict) -> float:
    return row["shaped_reward"] if row["shaped_reward"] is not None else row["reward"]
