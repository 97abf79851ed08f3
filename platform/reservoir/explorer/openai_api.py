"""The OpenAI chat-completions format `reservoir serve` speaks: requests checked field by field
(a bad one is an `ApiError` with the status, type and code an OpenAI client expects), and the
response objects and stream chunks built from the engine's samples.

Supported: model, messages (system, developer, user, assistant, tool; text content or text
parts), n, max_tokens / max_completion_tokens, temperature (absent, or the run's
explorer.temperature: the trainer scores tokens at it), logprobs, top_logprobs 0, user (names
the episode), stream and stream_options.include_usage, tools and tool_choice (passed to the
chat template; the reply is returned as text), and top_p 1, penalties 0, parallel_tool_calls.
Anything else is refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
# accepted when they ask for nothing our sampler does not do
NEUTRAL = {"top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": 0}
IGNORED = {"parallel_tool_calls", "store", "metadata"}
KNOWN = {"model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature",
         "logprobs", "user", "stream", "stream_options", "tools", "tool_choice",
         *NEUTRAL, *IGNORED}
EPISODE = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no spaces
SECRET = re.compile(r"[A-Za-z0-9_-]{16,100}")


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, code and the offending parameter."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type, code, param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    n: int
    max_tokens: int | None
    temperature: float
    logprobs: bool
    stream: bool
    usage_in_stream: bool
    tools: list | None
    episode: str | None


@dataclass(frozen=True)
class Limits:
    """What one call may ask for (serve.max_n, max_messages, max_tools)."""

    n: int = 16
    messages: int = 1000
    tools: int = 128


def parse_chat(body: Any, *, model: str, temperature: float, limits: Limits) -> ChatRequest:
    """The request, checked; ApiError naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise bad(unknown[0], "unrecognized request argument (not supported by reservoir "
                              "serve)")
    if body.get("model") != model:
        raise ApiError(404, f"The model {str(body.get('model'))[:80]!r} does not exist; this "
                            f"server serves {model!r}", code="model_not_found", param="model")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise bad(name, f"only {neutral} is supported (stored logprobs are those of the "
                            "sampling distribution the trainer scores)")
    asked = body.get("temperature")
    if asked is not None and (_number(asked, "temperature") != temperature):
        raise bad("temperature", f"this run samples at {temperature:g} (explorer.temperature: "
                                 "the trainer scores every token at it); leave it out")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                   for t in tools)):
        raise bad("tools", "a list of tool objects")
    if tools is not None and len(tools) > limits.tools:
        raise bad("tools", f"{len(tools)} tools; this server takes at most {limits.tools} "
                           "(serve.max_tools)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("tool_choice", "only auto or none (the reply comes back as text)")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise bad("stream_options", "only {include_usage: true|false}")
    return ChatRequest(
        messages=parse_messages(body.get("messages"), limits.messages),
        n=_count(body.get("n", 1), "n", 1, limits.n),
        max_tokens=_max_tokens(body),
        temperature=temperature, logprobs=_flag(body, "logprobs"), stream=_flag(body, "stream"),
        usage_in_stream=bool((options or {}).get("include_usage")), tools=tools,
        episode=_episode(body.get("user"), "user"))


def episode_of(header: str | None, request: ChatRequest) -> str | None:
    """The episode a call belongs to: the X-Episode-Id header, else the `user` field."""
    return _episode(header, "X-Episode-Id") if header is not None else request.episode


def _episode(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not EPISODE.fullmatch(value):
        raise bad(param, "an episode id is 1 to 200 printable ASCII characters without spaces")
    return value


def parse_messages(messages: Any, most: int) -> list[dict]:
    """Messages as the chat template takes them (developer -> system, text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of messages")
    if len(messages) > most:
        raise bad("messages", f"{len(messages)} messages; this server takes at most {most} "
                              "(serve.max_messages)")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(where, f"a message with a role ({', '.join(ROLES)})")
        extra = sorted(set(message) - MESSAGE_KEYS)
        if extra:
            raise bad(f"{where}.{extra[0]}", "unrecognized message field")
        content = _content(message.get("content"), f"{where}.content")
        if content is None and not message.get("tool_calls"):
            raise bad(f"{where}.content", "text content is required")
        parsed.append({**{k: v for k, v in message.items() if k != "refusal"},
                       "role": ROLES[message["role"]], "content": content or ""})
    if parsed[-1]["role"] == "assistant":
        raise bad("messages", "the last message is the assistant's: nothing to reply to")
    return parsed


def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        _text(content or "", where)
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str)
                                         for part in content):
        return _text("".join(part["text"] for part in content), where)
    raise bad(where, "text, or a list of {type: text, text} parts (no images or audio)")


def _text(text: str, where: str) -> str:
    if "\x00" in text:
        raise bad(where, "text cannot hold NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(where, "not valid Unicode text") from None
    return text


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(param, "a finite number")
    try:
        number = float(value)
    except OverflowError:
        raise bad(param, "a finite number (this one is past what a float holds)") from None
    if not math.isfinite(number):
        raise bad(param, "a finite number")
    return number


def _count(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(param, f"an integer from {low} to {high}")
    return value


def _flag(body: dict, param: str) -> bool:
    value = body.get(param, False)
    if value is not None and not isinstance(value, bool):
        raise bad(param, "true or false")
    return bool(value)


def _max_tokens(body: dict) -> int | None:
    for param in ("max_completion_tokens", "max_tokens"):
        if body.get(param) is not None:
            return _count(body[param], param, 1, 1_000_000)
    return None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _logprobs(tokenizer, sample) -> dict:
    pieces = [tokenizer.decode([token]) for token in sample.response_ids.tolist()]
    return {"content": [{"token": piece, "logprob": float(logprob),
                         "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                        for piece, logprob in zip(pieces, sample.logprobs.tolist())],
            "refusal": None}


def finish_reason(sample) -> str:
    return "stop" if sample.finished else "length"


def completion(call_id: str, model: str, version: int, request: ChatRequest, tokenizer,
               samples) -> dict:
    """A chat.completion object."""
    return {
        "id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": f"reservoir-v{version}",
        "choices": [{"index": index, "finish_reason": finish_reason(sample),
                     "message": {"role": "assistant", "content": sample.text, "refusal": None},
                     "logprobs": _logprobs(tokenizer, sample) if request.logprobs else None}
                    for index, sample in enumerate(samples)],
        "usage": usage(samples)}


def usage(samples) -> dict:
    prompt = len(samples[0].prompt_ids)
    completion_tokens = sum(len(sample.response_ids) for sample in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def stream(response: dict, usage_in_stream: bool) -> Iterator[str]:
    """The completion as server-sent chat.completion.chunk events, then [DONE]."""
    head = {key: response[key] for key in ("id", "created", "model", "system_fingerprint")}

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    for choice in response["choices"]:
        index = choice["index"]
        yield event([{"index": index, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None, "logprobs": None}])
        yield event([{"index": index, "delta": {"content": choice["message"]["content"]},
                      "finish_reason": None, "logprobs": choice["logprobs"]}])
        yield event([{"index": index, "delta": {}, "finish_reason": choice["finish_reason"],
                      "logprobs": None}])
    if usage_in_stream:
        yield event([], usage=response["usage"])
    yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class Feedback:
    episode: str
    secret: str | None            # what the episode's first call returned (X-Episode-Secret)
    rewards: list[float] | None   # one per response, or
    reward: float | None          # one for all
    components: dict[str, float]


FEEDBACK_KEYS = {"episode_id", "episode_secret", "reward", "rewards", "components"}


def parse_feedback(body: Any, reward_range: tuple[float, float],
                   secret_header: str | None = None) -> Feedback:
    """{episode_id, episode_secret (or the X-Episode-Secret header), reward | rewards,
    components?}, every number in the reward range; ApiError naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FEEDBACK_KEYS)
    if unknown:
        raise bad(unknown[0], "unrecognized field (episode_id, episode_secret, reward or "
                              "rewards, components)")
    episode = _episode(body.get("episode_id"), "episode_id")
    if episode is None:
        raise bad("episode_id", "required: the episode whose calls this rewards")
    secret = episode_secret(body.get("episode_secret", secret_header), "episode_secret")
    number = lambda value, param: _reward(value, param, reward_range)  # noqa: E731
    if ("reward" in body) == ("rewards" in body):
        raise bad("reward", "give reward (one for every response) or rewards (one per "
                            "response, in the order they were made)")
    components = body.get("components") or {}
    if not isinstance(components, dict) or "rewards" in body and components:
        raise bad("components", "a {name: number} mapping, with `reward` only")
    parts = {str(name): number(value, f"components.{name}") for name, value in components.items()}
    if "rewards" in body:
        rewards = body["rewards"]
        if not isinstance(rewards, list) or not rewards:
            raise bad("rewards", "a non-empty list of numbers")
        return Feedback(episode, secret, [number(r, f"rewards[{i}]")
                                          for i, r in enumerate(rewards)], None, {})
    reward = number(body["reward"], "reward")
    if parts and not math.isclose(sum(parts.values()), reward, rel_tol=1e-9, abs_tol=1e-9):
        raise bad("components", f"they sum to {sum(parts.values()):g}, not the reward {reward:g}")
    return Feedback(episode, secret, None, reward, parts)


def _reward(value: Any, param: str, reward_range: tuple[float, float]) -> float:
    low, high = reward_range
    reward = _number(value, param)
    if not low <= reward <= high:
        raise bad(param, f"{reward:g} is outside the reward range [{low:g}, {high:g}] "
                         "(explorer.reward_range)")
    return reward


def episode_secret(value: Any, param: str) -> str | None:
    """A secret as the server made it (URL-safe base64), else ApiError; None when absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not SECRET.fullmatch(value):
        raise bad(param, "the secret the episode's first call returned (X-Episode-Secret)")
    return value
