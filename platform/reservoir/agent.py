"""For agents served by `reservoir serve`: report an episode's reward (POST /v1/feedback).

    from openai import OpenAI
    from reservoir.agent import report_reward

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(model="my-run", messages=[...], user="episode-1")
    report_reward("http://127.0.0.1:8000/v1", "episode-1", 1.0)

Until its reward is reported an episode's calls are only recorded; then they become one group
of experiences, which the trainer can lease. Before the trainer has published the run's first
policy the server answers 503; `wait_for_policy` waits for it.
"""

from __future__ import annotations

import time
from typing import Sequence

import httpx

from reservoir.errors import ReservoirError


def report_reward(base_url: str, episode_id: str, reward: float | None = None, *,
                  rewards: Sequence[float] | None = None,
                  components: dict[str, float] | None = None, api_key: str | None = None,
                  timeout: float = 60.0) -> dict:
    """Give the episode one reward for every response (`reward`, optionally split into named
    `components` that sum to it) or one per response, in the order they were made
    (`rewards`). Returns the server's answer (responses written, their status, the group
    id); ReservoirError with the server's message when it refuses."""
    body: dict = {"episode_id": episode_id}
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
