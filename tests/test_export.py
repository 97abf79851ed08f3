"""`reservoir model export`: a checkpoint as a folder transformers loads, giving the trainer's
logits; LoRA runs merged or as a peft adapter folder; bad requests one line, nothing written."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from reservoir.models import build_tiny_model, load_model
from reservoir.prepare import ensure_run
from reservoir.trainer.batch import make_batch
from tests.commands import reservoir
from tests.test_lora import begun, lora_config
from tests.test_recovery import offline_groups

pytestmark = [pytest.mark.store_agnostic, pytest.mark.slow, pytest.mark.process]  # the same on any server: CI runs it once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("export") / "tiny", seed=6)


def trained(store, tmp_path, db_url, tiny, lora):
    """A learner of run 'lora' two steps in, its checkpoint of step 2 saved; the batch."""
    config = lora_config(tmp_path, db_url, tiny, lora=lora)
    ensure_run(store, config)
    store.write_groups(offline_groups("lora", 2))
    rows = sorted(store.lease("lora", groups=2).rows, key=lambda row: row.id)
    learner = begun(config)
    batch = make_batch(rows, learner.tokenizer.pad_token_id)
    learner.train(1, batch)
    learner.train(2, batch)
    learner.save(tmp_path / "ck" / "lora", 2, 0)
    learner.model.eval()
    return learner, batch


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def exported(tmp_path, db_url, *args) -> str:
    result = reservoir("model", "export", *args, url=db_url, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("lora", [None, {"rank": 8}], ids=["full", "lora"])
def test_an_export_gives_the_trainers_logits_in_transformers(store, tmp_path, db_url, tiny,
                                                             lora):
    learner, batch = trained(store, tmp_path, db_url, tiny, lora)
    exported(tmp_path, db_url, "lora@2", str(tmp_path / "out"))
    folder = tmp_path / "out"
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json"} <= {f.name for f in folder.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    torch.testing.assert_close(logits(model, batch), logits(learner.model, batch), atol=1e-5,
                               rtol=0)
    _, tokenizer = load_model(folder)
    assert tokenizer.chat_template == learner.tokenizer.chat_template


def test_a_lora_export_as_an_adapter_folder_loads_in_peft(store, tmp_path, db_url, tiny):
    from peft import PeftModel

    learner, batch = trained(store, tmp_path, db_url, tiny, {"rank": 8})
    exported(tmp_path, db_url, "lora", str(tmp_path / "adapter"), "--adapter")
    names = {f.name for f in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert "model.safetensors" not in names
    base, _ = load_model(tiny)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits(model, batch), logits(learner.model, batch), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("args, message", [
    (("nope@1", "OUT"), "run 'nope' does not exist"),
    (("lora@7", "OUT"), r"lora@7: no checkpoint of step 7 in .* \(checkpoints there: 2\)"),
    (("lora@x", "OUT"), "RUN or RUN@STEP"),
    (("lora", "OUT", "--adapter"), "--adapter: .* holds whole weights"),
    (("lora", "FULL"), "exists and is not an empty folder"),
])
def test_a_bad_export_is_one_line_and_writes_nothing(store, tmp_path, db_url, tiny, args,
                                                     message):
    import re

    trained(store, tmp_path, db_url, tiny, None)
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "kept.txt").write_text("mine")
    args = [str(tmp_path / a) if a in ("OUT", "FULL") else a for a in args]
    result = reservoir("model", "export", *args, url=db_url, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr.count("\n") <= 1, result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "OUT").exists() and not (tmp_path / "OUT.partial").exists()
    assert [f.name for f in (tmp_path / "FULL").iterdir()] == ["kept.txt"]
