"""`reservoir model export`: a run's checkpoint as a Hugging Face folder any tool loads.

The run's own stored config says where its checkpoints are and what its base model is. A full
run's checkpoint (whole, or a sharded run's DCP files, read here by one process) is written
again as a model folder with the base's tokenizer. A LoRA run's checkpoint holds adapters:
exported merged into the base (a plain model folder for transformers and vLLM), or with
`adapter` as a peft adapter folder (`adapter_config.json`, `adapter_model.safetensors`) over
the base at model.path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from reservoir.config import LoraConfig, ReservoirConfig
from reservoir.errors import ConfigError


def export(config: ReservoirConfig, checkpoint: Path, out: Path, *, adapter: bool = False
           ) -> Path:
    """Write `checkpoint` of the run `config` describes into the new folder `out`; the folder
    appears whole or not at all."""
    from reservoir.models import load_model
    from reservoir.trainer.adapters import with_adapters
    from reservoir.trainer.checkpoint import holds_adapters, load_weights_of

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; export into a new one")
    lora = holds_adapters(checkpoint)
    if adapter and not lora:
        raise ConfigError(f"--adapter: {checkpoint} holds whole weights (its run trained "
                          "without trainer.lora); export it without --adapter")
    model, tokenizer = load_model(config.model.path)
    if lora:  # adapters of the shape the run trained
        model = with_adapters(model, config.trainer.lora or LoraConfig(), seed=0)
    load_weights_of(checkpoint, model)
    if lora and not adapter:
        model = model.merge_and_unload()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return out
