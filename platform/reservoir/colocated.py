"""A colocated run's explorer: rounds generated with the trainer's own module, in its process.

With `run.placement: colocated` one process holds one model and alternates. When the trainer's
feed needs a batch it calls `refill`: an explorer (the same `ExplorerWorker` a split run
starts, with `shared=True`) claims the tasks the pace allows, generates them with the learner's
model in eval mode (the same tensors: no copy, no weight file, nothing to load), and writes the
groups through the store as any explorer does; then the run's stream pipelines pass over them
once, here. The trainer leases, trains and commits through the ledger as in a split run, so
every view, pipeline and guarantee of the store holds. Versions are published as store rows
without a weight file (checkpoints still write theirs).
"""

from __future__ import annotations

from reservoir.config import ReservoirConfig
from reservoir.explorer.batcher import Batcher
from reservoir.explorer.engine import TransformersEngine
from reservoir.explorer.worker import ExplorerStats, ExplorerWorker
from reservoir.pipeline.stream import PipelineWorker
from reservoir.store import Store


class Colocated:
    def __init__(self, config: ReservoirConfig, learner, store: Store, run_id: int) -> None:
        self.learner, self.store, self.run_id = learner, store, run_id
        self.explorer = ExplorerWorker(config, shared=True)
        self.stats = ExplorerStats(self.explorer.name)
        self.engine = TransformersEngine.of(learner.model, learner.tokenizer)
        self.batcher = Batcher(self.engine, inline=True)
        self.streams = [PipelineWorker(config, path, [config.run.name])
                        for path in config.pipelines]
        store.tasks.release_run_claims(run_id)  # a dead attempt's claims (the only explorer)

    def refill(self) -> bool:
        """Explore one round with the policy as it is now and let the stream pipelines pass
        over it; whether anything was explored (False: the pace allows nothing now)."""
        with self.learner.generating() as model:
            self.engine.model = model  # the learner's current module (sharding replaces it)
            outcome = self.explorer.round(self.store, self.run_id, self.batcher, self.stats)
        for stream in self.streams:
            stream.pass_once(self.store)
        return outcome == "explored"

    def close(self) -> None:
        self.batcher.close()
        self.explorer.release(self.store, quietly=True)

    def __enter__(self) -> "Colocated":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
