"""Runs over several PostgreSQL servers (`store.urls`): which server a run lives on, and the
config each part of it works with.

The first server's run_servers says where each run lives; a run is placed once, when it is
created. A part of a run (the driver, explorers, trainer ranks, stream pipelines, trackers) is
given the config `routed` returns: the same config with `store.url` set to the run's server and
`store.urls` cleared, so it talks to that server only and never reads run_servers again. A
server going down therefore stops only the runs on it; the first server going down stops new
runs and commands that look a run up, not runs already going.
"""

from __future__ import annotations

from reservoir.config import ReservoirConfig
from reservoir.errors import StoreError
from reservoir.logs import warn
from reservoir.plan.urls import server_key


def on_server(config: ReservoirConfig, url: str) -> ReservoirConfig:
    """The config working on one server only (run.store, a place in store.urls, goes too: the
    config must stay valid wherever it is read again, a worker's or the stored one)."""
    return config.model_copy(update={
        "store": config.store.model_copy(update={"url": url, "urls": ()}),
        "run": config.run.model_copy(update={"store": None})})


def every_server(config: ReservoirConfig) -> list[tuple[str | None, ReservoirConfig]]:
    """(server, config on it) for each server of store.urls; without urls the config as it is,
    its server None."""
    if not config.store.urls:
        return [(None, config)]
    return [(server_key(url), on_server(config, url)) for url in config.store.urls]


def routed(config: ReservoirConfig, run: str | None = None, *,
           create: bool = False) -> ReservoirConfig:
    """The config on the server of `run` (default run.name); as it is without store.urls.
    With `create`, a run placed nowhere yet is placed: on run.store's server if set, a branch
    on its parent's, else on the server whose runs declare the least demand. Without, such a
    run is a StoreError naming it."""
    return routed_each(config, [run or config.run.name], create=create)[0]


def routed_each(config: ReservoirConfig, runs: list[str], *,
                create: bool = False) -> list[ReservoirConfig]:
    """`routed` for each of `runs`, reading run_servers on one connection to the first
    server."""
    from reservoir.store import Store

    urls = config.store.urls
    if not urls:
        return [config] * len(runs)
    servers = [server_key(url) for url in urls]
    with Store.open(on_server(config, urls[0]), quiet=True, migrate=create) as first:
        placed = [_server_of(run, config, servers, first, create) for run in runs]
    return [on_server(config, urls[servers.index(server)]) for server in placed]


def _server_of(run: str, config: ReservoirConfig, servers: list[str], first,
               create: bool) -> str:
    """The run's server, one of `servers` (placed now with `create`)."""
    server = first.run_servers.server_of(run)
    if server is None and not create:
        raise StoreError(f"run {run!r} is on none of store.urls' servers (run_servers on "
                         f"{servers[0]} has no row for it): check its name")
    if server is None:
        chosen = _chosen(config, servers, first)
        answering, finished = (servers, []) if chosen else _answering(config)
        server = first.run_servers.place(run, answering, config.run.demand, chosen, finished)
    if server not in servers:
        raise StoreError(f"run {run!r} lives on {server}, a server store.urls does not name: "
                         "add that server's URL to store.urls")
    return server


def _answering(config: ReservoirConfig) -> tuple[list[str], list[str]]:
    """The servers a new run may go to (those that answer, each given the schema) and the
    runs on them that finished (their demand no longer counts); a server that does not answer
    is said in one line. StoreError when none answers."""
    from reservoir.store import Store, is_outage

    answering, finished = [], []
    for server, on_it in every_server(config):
        try:
            with Store.open(on_it, quiet=True, migrate=True) as store:
                finished += store.runs.finished_names()
        except Exception as exc:
            if not is_outage(exc):
                raise
            warn("store", f"server {server} does not answer: no new run goes there now")
            continue
        answering.append(server)
    if not answering:
        raise StoreError("store.urls: no server answers: a new run has nowhere to go")
    return answering, finished


def _chosen(config: ReservoirConfig, servers: list[str], first) -> str | None:
    """The server a new run must go to (a branch's parent's, or run.store's); None: any."""
    named = None if config.run.store is None else servers[config.run.store]
    if config.branch is None:
        return named
    parent = config.branch[0]
    server = first.run_servers.server_of(parent)
    if server is None:
        raise StoreError(f"run.branch_from: run {parent!r} is on none of store.urls' servers")
    if named not in (None, server):
        raise StoreError(f"run.store: a branch lives on its parent's server ({server}), not "
                         f"{named}: unset run.store")
    return server
