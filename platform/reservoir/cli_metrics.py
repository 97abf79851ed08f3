"""`reservoir metrics serve`: the store's gauges for Prometheus."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from reservoir.cli_common import ConfigOption, console, every_target
from reservoir.errors import ConfigError

metrics_app = typer.Typer(help="Prometheus metrics of the store.", no_args_is_help=True)


@metrics_app.command("serve")
def serve(host: str = typer.Option("127.0.0.1", help="Address to listen on (another than "
                                   "loopback needs a bearer token: --token-env)."),
          port: int = typer.Option(9464, min=1, max=65535, help="Port to listen on."),
          token_env: str = typer.Option("RESERVOIR_METRICS_TOKEN", help="Environment variable "
                                        "holding the bearer token scrapes must carry."),
          timeout: float = typer.Option(5.0, min=0.1, max=60.0, help="Seconds a scrape may "
                                        "spend reading the store (connect, then the query)."),
          runs: int = typer.Option(50, min=1, max=10_000, help="Runs read per scrape: the "
                                   "running ones and those changed in the last hour, newest "
                                   "first."),
          server: Optional[int] = typer.Option(
              None, "--server", min=0, max=1023, help="With store.urls: the server to "
              "export, by its place in the list (0 is the first); one exporter a server, as "
              "Prometheus scrapes one target a database."),
          config: Optional[Path] = ConfigOption) -> None:
    """Serve GET /metrics: per run rows waiting, ages, flow counters, steps, versions, lease
    and commit latency; per pipeline and schedule their last run and success; the database's
    size and connections. Read as the reader login, once per scrape. Ctrl-C stops."""
    from reservoir.http import check_free, is_loopback, run_app, url_of
    from reservoir.metrics.exporter import StoreCollector, create_app

    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError("reservoir metrics serve needs prometheus-client: "
                          "pip install 'reservoir[metrics]'") from None
    token = os.environ.get(token_env) or None
    if token is None and not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines; set a bearer "
                          f"token in the environment variable {token_env} first")
    check_free(host, port, "--port")
    where = _server(config, server)
    collector = StoreCollector(where.url, reader_url=where.reader_url, timeout_s=timeout,
                               runs=runs)
    console.print(f"metrics of the store at {url_of(host, port)}/metrics"
                  f"{' (bearer token required)' if token else ''}; Ctrl-C stops",
                  markup=False, highlight=False, soft_wrap=True)
    run_app(create_app(collector, host=host, port=port, token=token), host, port)


def _server(config: Optional[Path], index: Optional[int]):
    """The store's target, or with store.urls the one --server names."""
    targets = every_target(config)
    if targets[0][0] is None:
        if index is not None:
            raise ConfigError("--server: the config has no store.urls: leave it out")
        return targets[0][1]
    if index is None or index >= len(targets):
        raise ConfigError(f"--server: store.urls names {len(targets)} servers: give one of "
                          f"0..{len(targets) - 1} (one exporter a server)")
    return targets[index][1]
