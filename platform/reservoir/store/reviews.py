"""Queries on reviews: rows a pipeline held for a person, their verdicts and labels, the pairs
people choose, and `review_actions`, the log of every one of those actions (who, what, on
which rows, when, from where: the review page or the CLI). Each action and its row in the log
commit in one transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, exists, func, insert, or_, select, update
from sqlalchemy.orm import aliased

from reservoir.store import lifecycle
from reservoir.store.door import Door, reading, writing
from reservoir.errors import RowUnknown, StoreError
from reservoir.store.preferences import Pair, insert_pairs
from reservoir.store.schema import (experience_state, experiences, preferences, review_actions,
                                    reviews, runs)

VERDICT_STATUS = {"accept": "ready", "reject": "quarantined"}
SOURCES = ("web", "cli")


def _in_run(experience_id, run: str | None) -> list:
    """Conditions: the experience is of the run (none when `run` is None: any run)."""
    if run is None:
        return []
    run_id = select(runs.c.id).where(runs.c.name == run).scalar_subquery()
    return [experience_id.in_(select(experience_state.c.id)
                              .where(experience_state.c.run_id == run_id))]


def pending(conn: Connection, run: str | None, limit: int,
            after: int = 0) -> list[dict[str, Any]]:
    """Pending reviews (held rows), oldest first, from review id `after` on; each with its
    response's token ids and action mask and its run's model (to show it turn by turn)."""
    stmt = (select(reviews.c.id.label("review_id"), reviews.c.experience_id,
                   runs.c.name.label("run"), experiences.c.prompt_text.label("prompt"),
                   experiences.c.response_text.label("response"), experiences.c.reward,
                   reviews.c.reason, reviews.c.label, experiences.c.response_ids,
                   experiences.c.action_mask, runs.c.model)
            .join(experiences, experiences.c.id == reviews.c.experience_id)
            .join(runs, runs.c.id == experiences.c.run_id)
            .where(reviews.c.status == "pending", reviews.c.id > after)
            .order_by(reviews.c.id).limit(limit))
    if run:
        stmt = stmt.where(runs.c.name == run)
    return [dict(row) for row in conn.execute(stmt).mappings()]


def _log(conn: Connection, *, reviewer: str, action: str, source: str, **rows) -> int:
    if source not in SOURCES:
        raise StoreError(f"source {source!r}: use {' or '.join(SOURCES)}")
    if not reviewer or not reviewer.strip():
        raise StoreError("every review action names its reviewer; none was given")
    if rows.get("experience_id") is not None:  # an action names the experience's run too
        rows["run_id"] = (select(experience_state.c.run_id)
                          .where(experience_state.c.id == rows["experience_id"])
                          .scalar_subquery())
    return conn.execute(insert(review_actions).values(reviewer=reviewer, action=action,
                                                      source=source, **rows)
                        .returning(review_actions.c.id)).scalar_one()


def _labels(values: Any) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise StoreError(f"labels are a JSON object of name: value, not {type(values).__name__}")
    return values


def _unknown(review_id: int, run: str | None) -> RowUnknown:
    scope = f" of run {run!r}" if run else ""
    return RowUnknown(f"review {review_id} does not exist{scope} or is already labelled; "
                      "nothing was changed")


def label(conn: Connection, review_id: int, *, verdict: str, reviewer: str,
          values: dict[str, Any], source: str = "cli", run: str | None = None) -> str:
    """Record a verdict and release the held row (accept: ready, reject: quarantined) in one
    transaction, with its action row; returns the row's new status. With `run`, only a review
    of that run's rows is taken."""
    if verdict not in VERDICT_STATUS:
        raise StoreError(f"verdict {verdict!r}: use accept or reject")
    values = _labels(values)
    experience_id = conn.execute(
        update(reviews).where(reviews.c.id == review_id, reviews.c.status == "pending",
                              *_in_run(reviews.c.experience_id, run))
        .values(status="labelled", verdict=verdict, reviewer=reviewer, label=values,
                labelled_at=func.now()).returning(reviews.c.experience_id)).scalar()
    if experience_id is None:
        raise _unknown(review_id, run)
    lifecycle.settle_held(conn, experience_id, VERDICT_STATUS[verdict])
    _log(conn, reviewer=reviewer, action=verdict, source=source, review_id=review_id,
         experience_id=experience_id, detail={"label": values})
    return VERDICT_STATUS[verdict]


def set_label(conn: Connection, review_id: int, *, reviewer: str, values: dict[str, Any],
              source: str = "web", run: str | None = None) -> None:
    """Label a pending review (of `run`'s rows, when given) without deciding it (the row
    stays held)."""
    values = _labels(values)
    experience_id = conn.execute(
        update(reviews).where(reviews.c.id == review_id, reviews.c.status == "pending",
                              *_in_run(reviews.c.experience_id, run))
        .values(label=values).returning(reviews.c.experience_id)).scalar()
    if experience_id is None:
        raise _unknown(review_id, run)
    _log(conn, reviewer=reviewer, action="label", source=source, review_id=review_id,
         experience_id=experience_id, detail={"label": values})


def prefer(conn: Connection, chosen_id: int, rejected_id: int, *, reviewer: str,
           source: str = "cli", run: str | None = None) -> int | None:
    """Store a person's choice as a preference pair (source review:REVIEWER) with its action
    row; returns the pair's id, None if it was stored before. With `run`, both rows must be
    that run's."""
    if run is not None:
        found = conn.execute(select(func.count()).select_from(experience_state).where(
            experience_state.c.id.in_([chosen_id, rejected_id]),
            *_in_run(experience_state.c.id, run))).scalar()
        if found != len({chosen_id, rejected_id}):
            raise RowUnknown(f"experiences {chosen_id} and {rejected_id} are not both run "
                             f"{run!r}'s; no pair was added")
    added = insert_pairs(conn, [Pair(chosen_id, rejected_id, None, f"review:{reviewer}")])
    preference_id = added.get((chosen_id, rejected_id))
    _log(conn, reviewer=reviewer, action="prefer", source=source, experience_id=chosen_id,
         preference_id=preference_id, detail={"chosen": chosen_id, "rejected": rejected_id})
    return preference_id


def next_pair(conn: Connection, run: str | None, after: int = 0) -> list[dict[str, Any]]:
    """Two different responses to one task, from one group whose first row's id is over
    `after`, that no preference compares yet: [] when none is left."""
    a, b = aliased(experiences), aliased(experiences)
    compared = exists().where(or_(
        and_(preferences.c.chosen_id == a.c.id, preferences.c.rejected_id == b.c.id),
        and_(preferences.c.chosen_id == b.c.id, preferences.c.rejected_id == a.c.id)))
    stmt = (select(a.c.id.label("first"), b.c.id.label("second"))
            .join(b, and_(b.c.group_id == a.c.group_id, b.c.id > a.c.id,
                          b.c.response_text != a.c.response_text))
            .join(runs, runs.c.id == a.c.run_id)
            .where(a.c.id > after, ~compared).order_by(a.c.id, b.c.id).limit(1))
    if run:
        stmt = stmt.where(runs.c.name == run)
    found = conn.execute(stmt).first()
    if found is None:
        return []
    rows = conn.execute(select(experiences.c.id.label("experience_id"), runs.c.name.label("run"),
                               experiences.c.task_id, experiences.c.prompt_text.label("prompt"),
                               experiences.c.response_text.label("response"),
                               experiences.c.reward, experiences.c.response_ids,
                               experiences.c.action_mask, runs.c.model)
                        .join(runs, runs.c.id == experiences.c.run_id)
                        .where(experiences.c.id.in_(found)).order_by(experiences.c.id))
    return [dict(row) for row in rows.mappings()]


def recent_actions(conn: Connection, limit: int) -> list[dict[str, Any]]:
    stmt = (select(review_actions.c.id, review_actions.c.created_at, review_actions.c.reviewer,
                   review_actions.c.action, review_actions.c.source, review_actions.c.review_id,
                   review_actions.c.experience_id, review_actions.c.preference_id,
                   review_actions.c.detail)
            .order_by(review_actions.c.id.desc()).limit(limit))
    return [dict(row) for row in conn.execute(stmt).mappings()]


class Reviews(Door):
    """`store.reviews`: held rows waiting for a person, their verdicts and preferences."""

    pending = reading(pending)
    next_pair = reading(next_pair)
    recent_actions = reading(recent_actions)
    label = writing(label)
    set_label = writing(set_label)
    prefer = writing(prefer)
