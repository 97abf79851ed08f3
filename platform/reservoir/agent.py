"""For agents served by `reservoir serve`: an episode's calls and its reward.

    from openai import OpenAI
    from reservoir.agent import Episode

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    episode = Episode(client, "episode-1")
    reply = episode.create(model="my-run", messages=[...])
    episode.report(1.0)

An episode is bound to the client that opened it: its first call returns a secret
(X-Episode-Secret) that its later calls and its report must carry, which `Episode` does.
Until its reward is reported an episode's calls are only recorded; then they become one group
of experiences, which the trainer can lease. Before the trainer has published the run's first
policy the server answers 503; `wait_for_policy` waits for it.
"""

from __future__ import annotations

import time
from typing import Sequence

import httpx

from reservoir.errors import ReservoirError


class Episode:
    """One episode's calls through an `openai.OpenAI` client, and its reward. The secret its
    first call returned goes with every later call and with the report."""

    def __init__(self, client, episode_id: str, *, base_url: str | None = None) -> None:
        self.client, self.id = client, episode_id
        self.base_url = base_url or str(client.base_url)
        self.secret: str | None = None

    def create(self, **request):
        """`client.chat.completions.create(**request)` in this episode."""
        headers = {**request.pop("extra_headers", {}), "X-Episode-Id": self.id}
        if self.secret is not None:
            headers["X-Episode-Secret"] = self.secret
        raw = self.client.chat.completions.with_raw_response.create(extra_headers=headers,
                                                                    **request)
        self.secret = raw.headers.get("x-episode-secret") or self.secret
        return raw.parse()

    def report(self, reward: float | None = None, **options) -> dict:
        """`report_reward` for this episode (its client's key, its secret)."""
        options.setdefault("api_key", self.client.api_key)
        return report_reward(self.base_url, self.id, reward, secret=self.secret, **options)


def report_reward(base_url: str, episode_id: str, reward: float | None = None, *,
                  rewards: Sequence[float] | None = None,
                  components: dict[str, float] | None = None, api_key: str | None = None,
                  secret: str | None = None, timeout: float = 60.0) -> dict:
    """Give the episode one reward for every response (`reward`, optionally split into named
    `components` that sum to it) or one per response, in the order they were made
    (`rewards`); `secret` is what its first call returned (X-Episode-Secret). Returns the
    server's answer (responses written, their status, the group id); ReservoirError with the
    server's message when it refuses."""
    body: dict = {"episode_id": episode_id}
    if secret is not None:
        body["episode_secret"] = secret
    if rewards is not None:
        body["rewards"] = list(rewards)
    else:
        body["reward"] = reward
    if components:
        body["components"] = components
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{base_url.rstrip('/')}/feedback", json=body, headers=headers,
                          timeout=timeout)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise ReservoirError(f"reward of episode {episode_id!r}: HTTP {response.status_code}: "
                             f"{message}")
    return response.json()


def wait_for_policy(base_url: str, *, timeout_s: float = 600.0, every_s: float = 1.0) -> int:
    """Wait until the server serves a published policy version; returns it. ReservoirError
    after timeout_s (the server is not up, or no trainer publishes)."""
    health = f"{base_url.rstrip('/').removesuffix('/v1')}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            version = httpx.get(health, timeout=10).json()["policy_version"]
            if version is not None:
                return version
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise ReservoirError(f"{health}: no published policy after {timeout_s:g}s; is the "
                                 "server up and a trainer running (`reservoir train CONFIG`)?")
        time.sleep(every_s)
