"""Models without a hub: a small Qwen2 with a character tokenizer, built and saved locally.

`build_tiny_model` writes an ordinary Hugging Face folder (config, safetensors weights,
tokenizer with a chat template) with `save_pretrained`, so it loads through exactly the code path
of any real model: `load_model(path)`. Nothing is downloaded. head_dim is 64 so vLLM's CPU
kernels accept the model later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors, save_file, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config,
                          Qwen2ForCausalLM, PreTrainedTokenizerFast)
from transformers.utils import logging as transformers_logging

from reservoir.errors import ConfigError

transformers_logging.disable_progress_bar()  # our own progress display is the one to read

SPECIAL = ["<|pad|>", "<|unk|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """The shape of a tiny model; head_dim = hidden_size / heads must stay 64 for vLLM."""

    layers: int = 2
    hidden_size: int = 128
    heads: int = 2
    kv_heads: int = 1
    intermediate_size: int = 384
    max_positions: int = 512


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (so per character, for ASCII), plus the chat and padding tokens.

    Built as a byte-level BPE with no merges. That is what keeps it character-level after
    loading: transformers' AutoTokenizer loads any model_type=qwen2 folder as a Qwen2Tokenizer,
    which replaces the pre-tokenizer with Qwen's byte-level one (a plain character tokenizer
    silently lost its spaces that way); with a byte-level vocabulary both pipelines agree.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(SPECIAL + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", unk_token="<|unk|>", eos_token="<|end|>",
        additional_special_tokens=SPECIAL[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(out_dir: Path, *, seed: int = 0, spec: TinySpec = TinySpec()) -> Path:
    """Build a seeded tiny Qwen2 and its tokenizer and save both to out_dir."""
    if spec.hidden_size // spec.heads != 64:
        raise ConfigError(f"tiny model: hidden_size / heads = {spec.hidden_size // spec.heads}; "
                          "head_dim must be 64 (vLLM's CPU kernels reject smaller heads)")
    tokenizer = char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_model(path: Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local Hugging Face folder; never downloads."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model folder {path} has no config.json: build one with "
                          "`reservoir model tiny DIR` or point to a saved Hugging Face model")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model, tokenizer


def save_weights(model, path: Path) -> Path:
    """Write the model's weights as one safetensors file (tied weights stored once)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_model(model, str(partial))
    partial.rename(path)
    return path


def save_state(state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write named tensors (a model's weights computed apart from it) as one safetensors
    file, atomically as `save_weights` does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(state, str(partial))
    partial.rename(path)
    return path


def load_weights(model, path: Path) -> None:
    """Load weights written by `save_weights` into `model` in place."""
    load_safetensors(model, str(path), device=str(next(model.parameters()).device))
