"""What a workflow gets besides its task: the current policy, through the explorer's batcher.

A `Policy` is made for one task of one round. It samples (`sample`, one request of n), runs
multi-turn episodes (`episode`, and `reply` to step many episodes in one engine call), runs a
function several times side by side (`repeat`: e.g. an agent loop per sample, each in a thread
whose calls are batched with everyone else's), stands in for an OpenAI client (`client`),
scores with the task's reward function (`score`), and knows the run, task and policy version
the experiences it builds belong to.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from reservoir.chat import Message, prompt_ids
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.engine import Done, Request, Sample
from reservoir.explorer.episode import Episode
from reservoir.explorer.rewards import Components, RewardFunction, score
from reservoir.store import Experience


@dataclass(frozen=True)
class Sampling:
    n: int = 8                 # samples per task (the group size)
    temperature: float = 1.0   # 0 decodes greedily (evaluation)
    max_tokens: int = 16       # per model turn


@dataclass(frozen=True)
class Policy:
    batcher: Batcher
    sampling: Sampling
    reward: RewardFunction
    run: str
    task_id: int | None
    version: int
    order: tuple = ()          # this caller's place in a batch (see Batcher)

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def tokenizer(self):
        return self.batcher.engine.tokenizer

    @property
    def context(self) -> int:
        """Tokens the model can attend to (prompt and response together)."""
        return self.batcher.engine.context

    def sample(self, prompt: str | Sequence[Message], n: int | None = None, *,
               max_tokens: int | None = None) -> list[Sample]:
        """n responses (the policy's n unless given) to a prompt or a conversation. Every
        sample is drawn at the run's temperature, the one the trainer scores tokens at."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.batcher.generate([self._request(messages, n, max_tokens)], self.order)[0]

    @staticmethod
    def sample_round(policies: Sequence["Policy"], conversations: Sequence[Sequence[Message]],
                     on_done: Done | None = None) -> list[list[Sample]]:
        """Each policy's n responses to its conversation, all in one engine call (a workflow's
        `round`, on the exploring thread); `on_done(index, samples)` as each is ready."""
        first = policies[0]
        requests = [policy._request(messages) for policy, messages in zip(policies, conversations)]
        return first.batcher.generate_round(requests, first.order, on_done)

    def _request(self, messages: Sequence[Message], n: int | None = None,
                 max_tokens: int | None = None) -> Request:
        """n samples (the policy's unless given) of the conversation at the run's temperature."""
        return Request(prompt_ids(self.tokenizer, messages), n or self.n,
                       self.sampling.temperature, max_tokens or self.sampling.max_tokens)

    def episode(self, prompt: str | Sequence[Message]) -> Episode:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return Episode(self, messages)

    def reply(self, episodes: Sequence[Episode], *, max_tokens: int | None = None) -> list[str]:
        """The next model turn of each episode, in one engine call; "" for a truncated one."""
        requests = [episode.request(max_tokens=max_tokens or self.sampling.max_tokens,
                                    temperature=self.sampling.temperature)
                    for episode in episodes]
        live = [(episode, request) for episode, request in zip(episodes, requests) if request]
        samples = self.batcher.generate([r for _, r in live], self.order) if live else []
        texts = {id(episode): episode.take(group[0])
                 for (episode, _), group in zip(live, samples)}
        return [texts.get(id(episode), "") for episode in episodes]

    def repeat(self, function: Callable[["Policy"], Any], n: int | None = None) -> list:
        """`function(policy)` n times (the policy's n unless given), side by side: each in a
        thread of its own, whose generation is batched with the others'."""
        n = n or self.n
        self.batcher.join(n)

        def one(index: int):
            try:
                return function(replace(self, order=self.order + (index,)))
            finally:
                self.batcher.leave()

        with self.batcher.away(), ThreadPoolExecutor(n, thread_name_prefix="sample") as pool:
            futures = [pool.submit(one, index) for index in range(n)]
            return [future.result() for future in futures]

    def client(self):
        """An OpenAI-style client on this policy (reservoir.explorer.client): agent code that
        takes an `openai.OpenAI` takes it; its `group(reward)` is the task's group."""
        from reservoir.explorer.client import PolicyClient

        return PolicyClient(self)

    def score(self, response: str, answer: str | None) -> tuple[float, Components]:
        """The task's reward of a response: (total, components)."""
        return score(response, answer or "", [self.reward])

    def experience(self, prompt: str, sample: Sample, reward: float,
                   components: Components | None = None,
                   metadata: dict[str, Any] | None = None) -> Experience:
        """A single-turn sample of `prompt` as an experience (every response token trains)."""
        return Experience(
            run=self.run, task_id=self.task_id, policy_version=self.version,
            prompt_text=prompt, response_text=sample.raw_text,
            prompt_ids=sample.prompt_ids, response_ids=sample.response_ids,
            logprobs=sample.logprobs, action_mask=np.ones(len(sample.response_ids), np.uint8),
            reward=reward, reward_components=dict(components or {}),
            metadata={"finished": sample.finished, **(metadata or {})})
