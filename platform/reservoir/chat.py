"""The chat format: a conversation as token ids, and which of them the model wrote.

Conversations render through the model's own chat template. An episode's tokens are its prompt
(the messages before the first assistant turn, with the generation prompt), then every later
message in order: an assistant turn's tokens are the model's own (action mask 1, up to and
including the end-of-turn token), every other message's are the environment's (mask 0), each
with the template's framing around it. A message's tokens are what rendering the conversation
with it adds to rendering it without, so the template must only ever append: one that rewrites
earlier turns is refused in one line.

Shared by the explorer (episodes it samples), the trainer (sft on a task's demonstration) and
the server (each call's prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")


def render(tokenizer, messages: Sequence[Message], *, generation_prompt: bool,
           tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text (its special tokens are in the text already)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages: Sequence[Message], tools: list | None = None) -> list[int]:
    """The conversation so far, awaiting the assistant's turn."""
    return encode(tokenizer, render(tokenizer, messages, generation_prompt=True, tools=tools))


def added_text(tokenizer, before: Sequence[Message], after: Sequence[Message], *,
               generation_prompt: bool, before_prompt: bool = False) -> str:
    """What rendering `after` (which extends `before`) adds to rendering `before`."""
    old = render(tokenizer, before, generation_prompt=before_prompt)
    new = render(tokenizer, after, generation_prompt=generation_prompt)
    if not new.startswith(old):
        raise ValueError("the model's chat template rewrites earlier turns when a message is "
                         "added, so an episode's tokens cannot be built turn by turn")
    return new[len(old):]


@dataclass
class Tokens:
    """A conversation's prompt ids, then its response ids with the action mask (1: the model
    wrote it) and the sampled tokens' logprobs (0 where the mask is 0)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, ids: Sequence[int], *, model: bool, logprobs: Sequence[float] | None = None):
        self.response_ids.extend(int(i) for i in ids)
        self.mask.extend([int(model)] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else map(float, logprobs))


def check_messages(messages: Any, where: str) -> list[Message]:
    """A list of {role, content} messages with known roles and text content; ValueError
    naming `where` and the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation is a non-empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"} \
                or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {index} = {str(message)[:60]!r}: a message is "
                             f"{{role, content}} with role one of {', '.join(ROLES)} and text "
                             "content")
    return messages


def check_demonstration(messages: Any, where: str) -> list[Message]:
    """A conversation with a prompt message first and at least one assistant turn."""
    roles = [message["role"] for message in check_messages(messages, where)]
    if roles[0] == "assistant" or "assistant" not in roles:
        raise ValueError(f"{where}: a demonstration starts with a prompt message and holds at "
                         "least one assistant turn")
    return messages


def demonstration(tokenizer, messages: Sequence[Message]) -> Tokens:
    """A written conversation's tokens: the assistant turns train (mask 1), the rest do not."""
    roles = [message["role"] for message in check_demonstration(messages, "demonstration")]
    first = roles.index("assistant")
    tokens = Tokens(prompt_ids(tokenizer, messages[:first]))
    for index in range(first, len(messages)):
        is_model = roles[index] == "assistant"
        next_is_model = index + 1 < len(roles) and roles[index + 1] == "assistant"
        text = added_text(tokenizer, messages[:index], messages[:index + 1],
                          generation_prompt=next_is_model, before_prompt=is_model)
        ids = encode(tokenizer, text)
        if is_model:  # the model writes up to its end-of-turn token; framing after it is not its
            end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids \
                else len(ids)
            tokens.add(ids[:end], model=True)
            tokens.add(ids[end:], model=False)
        else:
            tokens.add(ids, model=False)
    return tokens
