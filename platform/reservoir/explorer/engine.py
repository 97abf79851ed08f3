"""Inference engines: batched generation with per-token logprobs.

An engine takes `Request`s (token ids to continue, n, temperature, max tokens) and returns, per
request, n `Sample`s holding the prompt and response token ids and the log-probability of each
response token under the sampling distribution (logits / temperature), which is what a
trainer's importance ratio compares against. Requests of one call may differ in everything;
the engine batches what it can. `sample` renders plain prompts as one user turn first. Engines
take new policy weights in place (`load_weights`), without being rebuilt;
`reservoir.explorer.engines.make_engine` picks one from the config.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from reservoir.chat import prompt_ids
from reservoir.errors import ReservoirError
from reservoir.models import load_model, load_weights


@dataclass(frozen=True)
class Sample:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    text: str  # without special tokens: what reward functions read
    raw_text: str  # every generated token, end-of-turn included: what the store keeps
    finished: bool  # ended with the end-of-turn token (not cut by max_tokens)


@dataclass(frozen=True)
class Request:
    """n continuations of one token sequence (a rendered chat prompt, or an episode so far);
    temperature 0 decodes greedily (logprobs then of the unscaled distribution)."""

    prompt_ids: Sequence[int]
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 32


Done = Callable[[int, list[Sample]], None]  # (request index, its samples), once each is done


class Engine(Protocol):
    tokenizer: object
    context: int  # positions the model attends to, prompt and response together

    def generate(self, requests: Sequence[Request], *, seed: int | None = None,
                 on_done: Done | None = None) -> list[list[Sample]]: ...

    def sample(self, prompts: list[str], n: int, *, temperature: float = 1.0,
               max_tokens: int = 32, seed: int | None = None) -> list[list[Sample]]: ...

    def load_weights(self, path: Path) -> None: ...


class Sampling:
    """`sample`, for engines that `generate`: n samples for each prompt, sent as one user turn
    through the chat template."""

    def sample(self, prompts: list[str], n: int, *, temperature: float = 1.0,
               max_tokens: int = 32, seed: int | None = None) -> list[list[Sample]]:
        return self.generate([Request(chat_ids(self.tokenizer, prompt), n, temperature,
                                      max_tokens) for prompt in prompts], seed=seed)


def take_policy(engine: Engine, location: str | None, model_path: Path) -> bool:
    """Load a published policy's weights in place, unless they are the model folder's own
    (version 0 of a fresh run); whether anything was loaded. A version without a location
    has no weight file: a colocated run's, which only its own process generates with."""
    if not location:
        raise ReservoirError("the run's latest policy version has no weight file: it is a "
                             "colocated run (run.placement: colocated), whose process "
                             "generates with the trainer's own weights; explore or serve it "
                             "from a run with placement: split")
    path = Path(location)
    if not (path.is_file() or path.resolve() != Path(model_path).resolve()):
        return False
    engine.load_weights(path)
    return True


def context_length(config) -> int:
    """Positions a model attends to: prompt and response together."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model's chat template renders a user turn awaiting the assistant."""
    return prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


class TransformersEngine(Sampling):
    """Hugging Face transformers `generate` on CPU or GPU, batched, with the KV cache."""

    def __init__(self, model_path: Path, *, device: str = "cpu", dtype=torch.float32,
                 batch_size: int = 256):
        model, tokenizer = load_model(model_path, dtype=dtype)
        self._take(model.to(device).eval(), tokenizer, device, batch_size)

    @classmethod
    def of(cls, model, tokenizer, *, batch_size: int = 256) -> "TransformersEngine":
        """An engine over a model already in memory (the trainer's, to evaluate it)."""
        engine = cls.__new__(cls)
        engine._take(model, tokenizer, str(next(model.parameters()).device), batch_size)
        return engine

    def _take(self, model, tokenizer, device: str, batch_size: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device, self.batch_size = device, batch_size
        self.context = context_length(model.config)

    def load_weights(self, path: Path) -> None:
        """Take new policy weights in place (the engine is not rebuilt): a safetensors file
        the trainer published, or a model folder."""
        path = Path(path)
        if path.is_file():
            load_weights(self.model, path)
        else:
            self.model.load_state_dict(load_model(path)[0].state_dict())

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], *, seed: int | None = None,
                 on_done: Done | None = None) -> list[list[Sample]]:
        """Each request's n samples. Rows (a request's prompt n times) that share temperature
        and max_tokens go through `generate` together, batch_size rows at a time, shortest
        prompts first (a chunk's prompts are padded to its longest only); `on_done` hears of
        each request as soon as the chunk that ends it is (its caller can score it while the
        next chunk generates)."""
        if seed is not None:
            torch.manual_seed(seed)
        rows = defaultdict(list)  # (temperature, max_tokens) -> (request index, prompt ids)
        for index, request in enumerate(requests):
            rows[(request.temperature, request.max_tokens)].extend(
                [(index, list(request.prompt_ids))] * request.n)
        out: list[list[Sample]] = [[] for _ in requests]
        for (temperature, max_tokens), chunk_rows in rows.items():
            chunk_rows.sort(key=lambda row: len(row[1]))  # stable: a request's rows together
            for start in range(0, len(chunk_rows), self.batch_size):
                chunk = chunk_rows[start:start + self.batch_size]
                samples = self._sample_chunk([ids for _, ids in chunk], temperature, max_tokens)
                for (index, _), one in zip(chunk, samples):
                    out[index].append(one)
                    if on_done is not None and len(out[index]) == requests[index].n:
                        on_done(index, out[index])
        return out

    def _sample_chunk(self, prompts: list[list[int]], temperature: float,
                      max_tokens: int) -> list[Sample]:
        width = max(len(ids) for ids in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts],
                                 device=self.device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts],
                                 device=self.device)
        greedy = temperature == 0  # then logprobs are those of the unscaled distribution
        # generate's greedy step takes the one token a sampling processor leaves
        sampling = {} if greedy else {"logits_processor": LogitsProcessorList(
            [InverseCdfSampling(temperature)])}
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention, do_sample=False, **sampling,
            max_new_tokens=max_tokens, return_dict_in_generate=True, output_logits=True,
            pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id,
            synced_gpus=False)  # alone, even where a sharded trainer's ranks are joined
        generated = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, generated[..., None])[..., 0]
        return self._samples(prompts, generated, logprobs)

    def _samples(self, prompts: list[list[int]], generated, logprobs) -> list[Sample]:
        """Rows cut after their end-of-turn token; texts decoded in one batch call each."""
        is_eos = generated == self.tokenizer.eos_token_id
        finished = is_eos.any(dim=1)
        lengths = torch.where(finished, is_eos.int().argmax(dim=1) + 1, generated.shape[1])
        generated, logprobs = generated.cpu().numpy(), logprobs.cpu().numpy()
        responses = [generated[i, :length] for i, length in enumerate(lengths.tolist())]
        texts = decode(self.tokenizer, responses, skip_special_tokens=True)
        raw_texts = decode(self.tokenizer, responses, skip_special_tokens=False)
        return [Sample(prompt_ids=np.asarray(prompts[i], dtype=np.int32),
                       response_ids=response.astype(np.int32),
                       logprobs=logprobs[i, :len(response)].astype(np.float32),
                       text=texts[i], raw_text=raw_texts[i], finished=bool(finished[i]))
                for i, response in enumerate(responses)]


class InverseCdfSampling(LogitsProcessor):
    """Each row's next token drawn from softmax(logits / temperature), the only one left
    (every other logit -inf), so generate's greedy step takes it; `output_logits` keeps the
    logits before this, which the engine's logprobs read. One uniform a row, placed in the
    row's cumulative distribution: torch's CPU `multinomial` draws an exponential for every
    entry of the vocabulary (0.7 ms a token for 128 rows of the tiny model's 262 on a 2-core
    CPU, against 0.1 ms here). Seeded by torch's generator, as sampling was."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float() / self.temperature, dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        # below the total: the first entry past u then always has a probability above 0
        u = torch.minimum(torch.rand_like(total) * total,
                          torch.nextafter(total, torch.zeros_like(total)))
        token = torch.searchsorted(cdf, u, right=True)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


def decode(tokenizer, rows, **options) -> list[str]:
    """Texts of token-id rows; NUL, which PostgreSQL text cannot hold, becomes U+FFFD."""
    return [text.replace("\x00", "\ufffd") for text in tokenizer.batch_decode(rows, **options)]
