"""Queries on reviews: rows a pipeline held for a person, and their verdicts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select, update

from reservoir.errors import StoreError
from reservoir.store.schema import experiences, reviews, runs

VERDICT_STATUS = {"accept": "ready", "reject": "quarantined"}


def pending(conn: Connection, run: str | None, limit: int) -> list[dict[str, Any]]:
    stmt = (select(reviews.c.id.label("review_id"), reviews.c.experience_id,
                   runs.c.name.label("run"), experiences.c.prompt_text.label("prompt"),
                   experiences.c.response_text.label("response"), experiences.c.reward,
                   reviews.c.reason)
            .join(experiences, experiences.c.id == reviews.c.experience_id)
            .join(runs, runs.c.id == experiences.c.run_id)
            .where(reviews.c.status == "pending").order_by(reviews.c.id).limit(limit))
    if run:
        stmt = stmt.where(runs.c.name == run)
    return [dict(row) for row in conn.execute(stmt).mappings()]


def label(conn: Connection, review_id: int, *, verdict: str, reviewer: str | None,
          values: dict[str, Any]) -> str:
    """Record a verdict and release the held row (accept: ready, reject: quarantined) in one
    transaction; returns the row's new status."""
    if verdict not in VERDICT_STATUS:
        raise StoreError(f"verdict {verdict!r}: use accept or reject")
    experience_id = conn.execute(
        update(reviews).where(reviews.c.id == review_id, reviews.c.status == "pending")
        .values(status="labelled", verdict=verdict, reviewer=reviewer, label=values,
                labelled_at=func.now()).returning(reviews.c.experience_id)).scalar()
    if experience_id is None:
        raise StoreError(f"review {review_id} does not exist or is already labelled")
    conn.execute(update(experiences).where(experiences.c.id == experience_id,
                                           experiences.c.status == "held")
                 .values(status=VERDICT_STATUS[verdict]))
    return VERDICT_STATUS[verdict]
