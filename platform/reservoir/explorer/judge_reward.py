"""Rewards scored by another model: `llm_judge` (any OpenAI-compatible endpoint, e.g. vLLM or
`reservoir serve`, asked with a rubric) and `reward_model` (a Hugging Face
sequence-classification model folder, run in the explorer's process, batched).

Options (`explorer.reward_options`):
- llm_judge: url (the endpoint's base, e.g. http://127.0.0.1:8000/v1), model, rubric (the
  system prompt; it must ask for a number), max_score (10), max_concurrency (4 requests at
  once), timeout_s (30), max_tokens (32), temperature (unset: the endpoint's; 0 for a
  deterministic judge where it allows), token_env (the variable holding a bearer token).
  The score is the last number of the judge's answer, divided by max_score; an answer
  without one, or outside [0, max_score], is a failure (reward_failed), not a score.
- reward_model: path (the model folder), device (cpu), batch_size (16), max_length (1024);
  the score is the model's single logit (num_labels 1), or the sigmoid of it with sigmoid: true.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from concurrent.futures import Future

import httpx

from reservoir.explorer.rewards import Components, Context

DEFAULT_RUBRIC = ("You grade answers. Read the question, the reference answer and the "
                  "response, then reply with one integer from 0 (wrong) to 10 (fully correct "
                  "and clear), and nothing else.")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_gates: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_gates_lock = threading.Lock()


def _gate(url: str, most: int) -> threading.BoundedSemaphore:
    with _gates_lock:
        return _gates.setdefault((url, most), threading.BoundedSemaphore(most))


def judge_score(text: str, max_score: float) -> float:
    """The last number of a judge's answer over max_score; ValueError without one in range.

    >>> judge_score("Score: 7", 10)
    0.7
    """
    found = _NUMBER.findall(text)
    if not found:
        raise ValueError(f"the judge's answer holds no score: {text[:80]!r}")
    score = float(found[-1])
    if not 0 <= score <= max_score:
        raise ValueError(f"the judge's score {score:g} is outside [0, {max_score:g}]")
    return score / max_score


def llm_judge(response: str, answer: str, *, context: Context = Context()) -> Components:
    """A judge model's score of the response against the rubric, in [0, 1]."""
    options = context.options
    if not options.get("url"):
        raise ValueError("llm_judge needs explorer.reward_options.url (an OpenAI-compatible "
                         "endpoint)")
    url = str(options["url"]).rstrip("/")
    token = os.environ.get(str(options.get("token_env", "")), "") if options.get("token_env") \
        else ""
    question = (f"Question:\n{context.prompt}\n\nReference answer:\n{answer}\n\n"
                f"Response:\n{response}\n\nScore:")
    body = {"model": options.get("model", "judge"),
            "max_tokens": int(options.get("max_tokens", 32)),
            "messages": [{"role": "system", "content": options.get("rubric", DEFAULT_RUBRIC)},
                         {"role": "user", "content": question}]}
    if options.get("temperature") is not None:  # else the endpoint's own (serve: the run's)
        body["temperature"] = float(options["temperature"])
    with _gate(url, int(options.get("max_concurrency", 4))):
        reply = httpx.post(f"{url}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {token}"} if token else {},
                           timeout=float(options.get("timeout_s", 30.0)))
    if reply.status_code != 200:
        raise ValueError(f"the judge answered {reply.status_code}: {reply.text[:300]}")
    text = reply.json()["choices"][0]["message"]["content"] or ""
    return {"judge": judge_score(text, float(options.get("max_score", 10)))}


class _Scorer:
    """A sequence-classification model and a thread that scores requests in batches: calls
    from several workflow threads that arrive together run as one forward pass."""

    def __init__(self, path: str, device: str, batch_size: int, max_length: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.device = torch, device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has one label (num_labels 1), not "
                             f"{self.model.config.num_labels}")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length = batch_size, max_length
        self.requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name="reward-model").start()

    def score(self, prompt: str, response: str) -> float:
        done: Future = Future()
        self.requests.put((prompt, response, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            batch = [self.requests.get()]
            while len(batch) < self.batch_size:
                try:
                    batch.append(self.requests.get(timeout=0.005))
                except queue.Empty:
                    break
            try:
                scores = self._forward([(p, r) for p, r, _ in batch])
                for (_, _, done), value in zip(batch, scores):
                    done.set_result(value)
            except Exception as exc:  # each caller sees the failure as its reward's
                for _, _, done in batch:
                    done.set_exception(exc)

    def _forward(self, pairs: list[tuple[str, str]]) -> list[float]:
        encoded = self.tokenizer([p for p, _ in pairs], [r for _, r in pairs], padding=True,
                                 truncation=True, max_length=self.max_length,
                                 return_tensors="pt").to(self.device)
        with self.torch.no_grad():
            return self.model(**encoded).logits[:, 0].float().tolist()


_scorers: dict[tuple, _Scorer] = {}
_scorers_lock = threading.Lock()


def _scorer(options: dict) -> _Scorer:
    if not options.get("path"):
        raise ValueError("reward_model needs explorer.reward_options.path (a sequence-"
                         "classification model folder)")
    key = (str(options["path"]), str(options.get("device", "cpu")),
           int(options.get("batch_size", 16)), int(options.get("max_length", 1024)))
    with _scorers_lock:
        if key not in _scorers:
            _scorers[key] = _Scorer(*key)
        return _scorers[key]


def reward_model(response: str, answer: str, *, context: Context = Context()) -> Components:
    """A reward model's score of (prompt, response)."""
    value = _scorer(context.options).score(context.prompt, response)
    if context.options.get("sigmoid"):
        import math
        value = 1 / (1 + math.exp(-value))
    return {"reward_model": value}
