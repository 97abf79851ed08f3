"""`reservoir pipeline check`: a pipeline file, its operators and expectations, without running."""

from __future__ import annotations

from pathlib import Path

from reservoir.errors import ConfigError
from reservoir.pipeline.bridge import Step, build_steps
from reservoir.pipeline.spec import PipelineSpec, load_pipeline
from reservoir.pipeline.validate import check_specs


def check_file(path: Path) -> tuple[PipelineSpec, list[Step]]:
    """The spec and its operators; a ConfigError names the file, the key or operator, and why."""
    spec = load_pipeline(path)
    try:
        steps = build_steps(spec.operators, spec.text_key)
        check_specs(spec.validate_.expectations)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return spec, steps
