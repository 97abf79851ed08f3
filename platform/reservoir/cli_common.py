"""What every `reservoir` subcommand shares: the console and the store a -c CONFIG names."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from reservoir.config import ReservoirConfig, load_config
from reservoir.store import Store

console = Console()
ConfigOption = typer.Option(None, "--config", "-c", help="Config YAML (store, sampler, ...).")


def _config(path: Optional[Path]) -> ReservoirConfig:
    return load_config(path)


def _open(path: Optional[Path]) -> Store:
    return Store.open(_config(path))
