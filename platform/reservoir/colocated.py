"""A colocated run's explorer: rounds generated with the trainer's own module, in its process.

With `run.placement: colocated` one process holds one model and alternates. When the trainer's
feed needs a batch it calls `refill`: an explorer (the same `ExplorerWorker` a split run
starts, with `shared=True`) claims the tasks the pace allows, generates them with the learner's
model in eval mode (the same tensors: no copy, no weight file, nothing to load), and writes the
groups through the store as any explorer does; then the run's stream pipelines pass over them
once, here. The trainer leases, trains and commits through the ledger as in a split run, so
every view, pipeline and guarantee of the store holds. Versions are published as store rows
without a weight file (checkpoints still write theirs).

A served run (`serve:`) serves `reservoir serve`'s endpoint from this process: its calls are
batched on the same module, generating only while `refill` lets them (the trainer holds the
engine while it trains), so every call's samples come from the version it is tagged with.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager

import torch

from reservoir.config import ReservoirConfig
from reservoir.errors import FlowControlTimeout
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.engine import TransformersEngine
from reservoir.explorer.worker import ExplorerStats, ExplorerWorker
from reservoir.http import serving, url_of
from reservoir.pipeline.stream import PipelineWorker
from reservoir.store import Store

SERVE_WINDOW_S = 0.5  # the calls generate this long a refill, less once an episode is reported


class Colocated:
    def __init__(self, config: ReservoirConfig, learner, store: Store, run_id: int) -> None:
        self.config, self.learner, self.store, self.run_id = config, learner, store, run_id
        self.explorer = ExplorerWorker(config, shared=True)
        self.stats = ExplorerStats(self.explorer.name)
        self.engine = TransformersEngine.of(learner.model, learner.tokenizer)
        self.batcher = Batcher(self.engine, inline=True)
        self.streams = [PipelineWorker(config, path, [config.run.name])
                        for path in config.pipelines]
        store.tasks.release_run_claims(run_id)  # a dead attempt's claims (the only explorer)
        self._closing = ExitStack()
        try:
            self.server = self._serve() if config.serve is not None else None
        except BaseException:
            self._closing.close()
            raise
        self._quiet_since = time.monotonic()

    def _serve(self):
        """The endpoint on this process's module, its engine held until a refill lets go."""
        from reservoir.explorer.serve import Server, create_app

        server = Server(self.config, self.engine)
        self._closing.callback(server.close)
        server.batcher.hold()
        http = ExitStack()
        self._closing.callback(self._stop_serving, server, http)
        http.enter_context(serving(create_app(server), self.config.serve.host,
                                   self.config.serve.port))
        return server

    def _stop_serving(self, server, http: ExitStack) -> None:
        """The calls waiting generate once more (on the module in eval mode), then the
        endpoint stops."""
        with self.learner.generating():
            server.batcher.let_go()
            http.close()

    def refill(self) -> bool:
        """Explore one round with the policy as it is now, let a served run's calls generate
        meanwhile, and let the stream pipelines pass over what came; whether anything came
        (False: the pace allows nothing now). FlowControlTimeout when a served run heard of no
        episode and explored nothing for trainer.wait_timeout_s."""
        with self.learner.generating() as model, self._explorer_threads():
            self.engine.model = model  # the learner's current module (sharding replaces it)
            explored = self.explorer.round(self.store, self.run_id, self.batcher,
                                           self.stats) == "explored"
            reported = self.server is not None and self._serve_calls()
        for stream in self.streams:
            stream.pass_once(self.store)
        if self.server is None or explored or reported:
            self._quiet_since = time.monotonic()
            return explored or reported
        waited, limit = time.monotonic() - self._quiet_since, self.config.trainer.wait_timeout_s
        if waited > limit:
            serve = self.config.serve
            raise FlowControlTimeout(
                f"trainer.wait_timeout_s: no episode was reported to "
                f"{url_of(serve.host, serve.port)}/v1 and no task was explored in {limit:g}s")
        return True

    @contextmanager
    def _explorer_threads(self):
        """torch's threads while the round generates: explorer.threads where it is set (the
        trainer's, trainer.threads or every core, otherwise), the trainer's again after."""
        wanted, threads = self.config.explorer.threads, torch.get_num_threads()
        torch.set_num_threads(wanted or threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _serve_calls(self) -> bool:
        """Calls generate with the version the explorer holds (the latest published) until an
        episode is reported or SERVE_WINDOW_S pass; whether one was."""
        batcher = self.server.batcher
        batcher.tag = self.explorer.version
        self.server.reported.clear()
        batcher.let_go()
        try:
            return self.server.reported.wait(SERVE_WINDOW_S)
        finally:
            batcher.hold()

    def close(self) -> None:
        try:
            self._closing.close()
        finally:
            self.batcher.close()
            self.explorer.release(self.store, quietly=True)

    def __enter__(self) -> "Colocated":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
