"""The tiny local model: built, saved and loaded like any Hugging Face model; nothing downloads."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reservoir.errors import ConfigError
from reservoir.models import TinySpec, build_tiny_model, char_tokenizer, load_model

pytestmark = pytest.mark.store_agnostic  # the same on any server: CI runs it once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=3)


def test_loads_through_the_auto_classes(tiny):
    model, tokenizer = load_model(tiny)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    assert len(tokenizer) == model.config.vocab_size


@pytest.mark.parametrize("text", ["What is 12 + 30?\nThe answer is 42.", "reverse 'abc'  ", "é"])
def test_the_loaded_tokenizer_is_still_one_token_per_byte(tiny, text):
    _, loaded = load_model(tiny)
    ids = loaded(text)["input_ids"]
    assert ids == char_tokenizer()(text)["input_ids"]
    assert len(ids) == len(text.encode()) and loaded.decode(ids) == text


def test_chat_template_ends_with_the_assistant_turn(tiny):
    _, tokenizer = load_model(tiny)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hi<|end|><|assistant|>"


def test_same_seed_same_weights_other_seed_other_weights(tiny, tmp_path):
    again = load_model(build_tiny_model(tmp_path / "again", seed=3))[0].state_dict()
    other = load_model(build_tiny_model(tmp_path / "other", seed=4))[0].state_dict()
    first = load_model(tiny)[0].state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_generates(tiny):
    model, tokenizer = load_model(tiny)
    prompt = tokenizer("<|user|>hi<|end|><|assistant|>", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=True)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_head_dim_other_than_64_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="head_dim must be 64"):
        build_tiny_model(tmp_path / "m", spec=TinySpec(hidden_size=96, heads=3 * 2))


def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "nowhere")):
        load_model(tmp_path / "nowhere")


@pytest.mark.slow
@pytest.mark.process
def test_cli_builds_a_model(tmp_path):
    script = Path(sys.executable).with_name("reservoir")
    done = subprocess.run([str(script), "model", "tiny", str(tmp_path / "m"), "--layers", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_model(tmp_path / "m")[0].config.num_hidden_layers == 3
