"""Queries on served episodes: the calls an agent makes through `reservoir serve`, kept until
its reward comes, then written as one group of experiences.

An episode is named by the client (unique within the run) and bound to it: its first call
makes a secret (returned once, kept as its SHA-256), and a later call or the report naming the
episode is taken only with it (EpisodeForbidden). It is `open` while calls come in:
every response of every call is an `episode_calls` row (prompt and response ids, logprobs, the
policy version and temperature that made it). `report` writes the episode's responses as one
group (raw or ready, through the writer: the same checks and counters as an explorer's) and, in
the same transaction, marks the episode `reported` and deletes its calls; a call that slipped
in meanwhile makes the report fail whole (EpisodeClosed: report again). An episode that never
gets a reward never trains.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from sqlalchemy import Connection, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from reservoir.store.door import Door, reading, writing
from reservoir.errors import EpisodeClosed, EpisodeForbidden, EpisodeUnknown, StoreError
from reservoir.store import codec
from reservoir.store.records import Experience
from reservoir.store.schema import episode_calls, episodes


@dataclass(frozen=True)
class Call:
    """One response of one chat completion."""

    call_id: str
    choice: int
    policy_version: int
    temperature: float
    prompt_text: str
    response_text: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str

    def experience(self, *, run: str, task_id: int | None, version: int,
                   group_id: uuid.UUID, episode: str) -> Experience:
        """The response as a row of its episode's group (reward 0 until `rewarded`): every
        token is the model's (mask 1); its own version and the call are in metadata, the
        group's version is its oldest response's."""
        return Experience(
            run=run, task_id=task_id, prompt_text=self.prompt_text,
            response_text=self.response_text, prompt_ids=self.prompt_ids,
            response_ids=self.response_ids, reward=0.0, policy_version=version,
            group_id=group_id, logprobs=self.logprobs,
            action_mask=np.ones(len(self.response_ids), np.uint8),
            metadata={"episode": episode, "call": self.call_id, "choice": self.choice,
                      "policy_version": self.policy_version, "temperature": self.temperature,
                      "finish_reason": self.finish_reason})


def as_group(calls: Sequence[Call], *, run: str, task_id: int | None,
             episode: str) -> list[Experience]:
    """An episode's responses as one group (one new group id)."""
    version, group_id = min(call.policy_version for call in calls), uuid.uuid4()
    return [call.experience(run=run, task_id=task_id, version=version, group_id=group_id,
                            episode=episode) for call in calls]


def _digest(secret: str | None) -> bytes | None:
    return None if secret is None else hashlib.sha256(secret.encode()).digest()


def _check_client(key: str, kept: bytes | None, secret: str | None) -> None:
    """EpisodeForbidden unless `secret` is the episode's (an episode opened before secrets
    were kept has none, and takes any client)."""
    if kept is not None and not (secret is not None
                                 and hmac.compare_digest(kept, _digest(secret))):
        raise EpisodeForbidden(f"episode {key!r} belongs to the client that opened it: send "
                               "the X-Episode-Secret its first call returned")


def check_caller(conn: Connection, run_id: int, key: str, secret: str | None) -> None:
    """Before any work for a call: EpisodeClosed or EpisodeForbidden if the episode exists and
    will not take it (`record_calls` checks again, holding the episode)."""
    found = conn.execute(select(episodes.c.status, episodes.c.secret_sha256).where(
        episodes.c.run_id == run_id, episodes.c.key == key)).one_or_none()
    if found is not None:
        _check_client(key, found.secret_sha256, secret)
        if found.status != "open":
            raise EpisodeClosed(f"episode {key!r} was reported already: it takes no more calls "
                                "(start a new episode id)")


def record_calls(conn: Connection, run_id: int, key: str, calls: Sequence[Call], *,
                 secret: str | None = None) -> tuple[int, str | None]:
    """Add a call's responses to the episode: (its id, the secret made for it when this call
    opened it, else None). EpisodeForbidden without the episode's secret, EpisodeClosed if its
    reward was reported already."""
    fresh = secrets.token_urlsafe(24)
    opened = conn.execute(pg_insert(episodes).values(run_id=run_id, key=key,
                                                     secret_sha256=_digest(fresh))
                          .on_conflict_do_nothing(constraint="episodes_run_key")
                          .returning(episodes.c.id)).scalar()
    episode_id, status, kept = conn.execute(
        select(episodes.c.id, episodes.c.status, episodes.c.secret_sha256)
        .where(episodes.c.run_id == run_id, episodes.c.key == key).with_for_update()).one()
    if opened is None:
        _check_client(key, kept, secret)
    if status != "open":
        raise EpisodeClosed(f"episode {key!r} was reported already: it takes no more calls "
                            "(start a new episode id)")
    conn.execute(episode_calls.insert(), [{
        "episode_id": episode_id, "call_id": call.call_id, "choice": call.choice,
        "policy_version": call.policy_version, "temperature": call.temperature,
        "prompt_text": call.prompt_text, "response_text": call.response_text,
        "prompt_ids": codec.encode(call.prompt_ids, codec.TOKEN),
        "response_ids": codec.encode(call.response_ids, codec.TOKEN),
        "logprobs": codec.encode(call.logprobs, codec.LOGPROB),
        "finish_reason": call.finish_reason} for call in calls])
    return episode_id, fresh if opened is not None else None


@dataclass(frozen=True)
class OpenEpisode:
    id: int
    key: str
    call_ids: list[int]      # episode_calls ids, in the order the responses were made
    group: list[Experience]  # the responses as experiences (rewards filled in by `rewarded`)


def open_episode(conn: Connection, run: str, run_id: int, key: str,
                 secret: str | None = None) -> OpenEpisode:
    """The episode's recorded responses as a group of the run (`as_group`).
    EpisodeUnknown / EpisodeForbidden (without its secret) / EpisodeClosed."""
    found = conn.execute(select(episodes.c.id, episodes.c.status, episodes.c.secret_sha256)
                         .where(episodes.c.run_id == run_id, episodes.c.key == key)
                         ).one_or_none()
    if found is None:
        raise EpisodeUnknown(f"episode {key!r}: run {run!r} has no calls of it")
    _check_client(key, found.secret_sha256, secret)
    if found.status != "open":
        raise EpisodeClosed(f"episode {key!r}: its reward was reported already")
    rows = conn.execute(select(episode_calls).where(episode_calls.c.episode_id == found.id)
                        .order_by(episode_calls.c.id)).all()
    calls = [Call(row.call_id, row.choice, row.policy_version, row.temperature,
                  row.prompt_text, row.response_text, codec.decode(row.prompt_ids, codec.TOKEN),
                  codec.decode(row.response_ids, codec.TOKEN),
                  codec.decode(row.logprobs, codec.LOGPROB), row.finish_reason)
             for row in rows]
    return OpenEpisode(found.id, key, [row.id for row in rows],
                       as_group(calls, run=run, task_id=None, episode=key))


def rewarded(group: list[Experience], rewards: Sequence[float],
             components: Sequence[dict[str, float]] | None = None) -> list[Experience]:
    """The group with each response's reward and its components ({"reward": r} unless
    given)."""
    if len(rewards) != len(group):
        raise StoreError(f"{len(group)} responses, {len(rewards)} rewards")
    parts = components or [{"reward": float(reward)} for reward in rewards]
    for row, reward, named in zip(group, rewards, parts):
        row.reward, row.reward_components = float(reward), dict(named)
    return group


def closing(episode: OpenEpisode, reward: float | None):
    """What the writer runs in the group's transaction: the episode becomes reported (it must
    still be open) and its calls go, exactly those read (none arrived since)."""
    async def close(conn: AsyncConnection) -> None:
        closed = (await conn.execute(
            update(episodes).where(episodes.c.id == episode.id, episodes.c.status == "open")
            .values(status="reported", reward=reward, reported_at=func.now(),
                    group_id=episode.group[0].group_id).returning(episodes.c.id))).scalar()
        if closed is None:
            raise EpisodeClosed(f"episode {episode.key!r}: its reward was reported already")
        deleted = (await conn.execute(delete(episode_calls)
                                      .where(episode_calls.c.episode_id == episode.id)
                                      .returning(episode_calls.c.id))).scalars().all()
        if sorted(deleted) != episode.call_ids:
            raise EpisodeClosed(f"episode {episode.key!r}: a call arrived while its reward was "
                                "reported; nothing was written, report it again")
    return close


class Episodes(Door):
    """`store.episodes`: served calls grouped into episodes until their feedback."""

    check_caller = reading(check_caller)
    open_episode = reading(open_episode)
    record_calls = writing(record_calls)
