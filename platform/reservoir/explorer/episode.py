"""A multi-turn episode: one experience whose response holds the model's turns and the
environment's, with the action mask telling them apart.

    episode = policy.episode("Compute 12*34")
    text = episode.reply()               # the model's turn: sampled tokens, mask 1, logprobs
    episode.add("tool", "408")           # the environment's turn: template tokens, mask 0
    text = episode.reply()
    return [episode.experience(reward)]

The model's tokens are the sampled ones exactly; everything between them is what the chat
template renders for the other messages (reservoir.chat), so the sequence the trainer scores
is the one the model saw. An episode ends itself when a turn is cut by max_tokens or the model's
context is full (`truncated`); `reply` then returns "" without sampling.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from reservoir.chat import Message, Tokens, added_text, encode, prompt_ids, render
from reservoir.explorer.engine import Request, Sample, decode
from reservoir.store import Experience


class Episode:
    def __init__(self, policy, messages: Sequence[Message]) -> None:
        self.policy = policy
        self.messages: list[Message] = list(messages)
        only_user = len(self.messages) == 1 and self.messages[0]["role"] == "user"
        self.prompt_text = (self.messages[0]["content"] if only_user else
                            render(policy.tokenizer, self.messages, generation_prompt=True))
        self.tokens = Tokens(prompt_ids(policy.tokenizer, self.messages))
        self._in_tokens = len(self.messages)  # messages already in the tokens
        self.turns = 0
        self.truncated = False

    def add(self, role: str, content: str) -> None:
        """An environment or tool message; its tokens join before the model's next turn."""
        self.messages.append({"role": role, "content": content})

    def reply(self, max_tokens: int | None = None) -> str:
        """The model's next turn (at most max_tokens: the policy's unless given)."""
        return self.policy.reply([self], max_tokens=max_tokens)[0]

    def request(self, *, max_tokens: int, temperature: float) -> Request | None:
        """The next turn's request (messages added since the last turn rendered first); None
        once the episode is truncated."""
        if self.truncated:
            return None
        tokenizer = self.policy.tokenizer
        if len(self.messages) > self._in_tokens:
            text = added_text(tokenizer, self.messages[:self._in_tokens], self.messages,
                              generation_prompt=True)
            self.tokens.add(encode(tokenizer, text), model=False)
            self._in_tokens = len(self.messages)
        ids = self.tokens.prompt_ids + self.tokens.response_ids
        room = self.policy.context - len(ids)
        if room <= 0:
            self.truncated = True
            return None
        return Request(ids, 1, temperature, min(max_tokens, room))

    def take(self, sample: Sample) -> str:
        """Append the model's sampled turn; returns its text."""
        self.tokens.add(sample.response_ids, model=True, logprobs=sample.logprobs)
        self.messages.append({"role": "assistant", "content": sample.text})
        self._in_tokens = len(self.messages)
        self.turns += 1
        self.truncated = not sample.finished
        if sample.finished:  # framing the template puts after the model's end of turn
            rendered = added_text(self.policy.tokenizer, self.messages[:-1], self.messages,
                                  generation_prompt=False, before_prompt=True)
            if rendered.startswith(sample.raw_text) and len(rendered) > len(sample.raw_text):
                self.tokens.add(encode(self.policy.tokenizer, rendered[len(sample.raw_text):]),
                                model=False)
        return sample.text

    def experience(self, reward: float, components: dict[str, float] | None = None,
                   metadata: dict[str, Any] | None = None) -> Experience:
        """The episode as one experience of the policy's run, task and version."""
        tokens, policy = self.tokens, self.policy
        response_text = decode(policy.tokenizer, [tokens.response_ids],
                               skip_special_tokens=False)[0]
        return Experience(
            run=policy.run, task_id=policy.task_id, policy_version=policy.version,
            prompt_text=self.prompt_text, response_text=response_text,
            prompt_ids=np.asarray(tokens.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(tokens.response_ids, dtype=np.int32),
            logprobs=np.asarray(tokens.logprobs, dtype=np.float32),
            action_mask=np.asarray(tokens.mask, dtype=np.uint8), reward=reward,
            reward_components=dict(components or {}),
            metadata={"turns": self.turns, "truncated": self.truncated, **(metadata or {})})
