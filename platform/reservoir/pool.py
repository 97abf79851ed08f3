"""Worker pools and the ways to start a run: `run` (both sides), `explore`, `train`, and
`serve` (an OpenAI-compatible endpoint agents feed the run through).

`reservoir run` starts a trainer and `explorer.workers` explorers as Ray actors (a local Ray by
default, `run.ray_address` for a cluster) and shows the run live from the store. `explore` and
`train` start one side only, so two processes or machines can split a run over one server URL.
Ctrl-C asks every worker to stop: the trainer finishes its step, checkpoints and marks the run
stopped; explorers give their claimed tasks back. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import math
import signal
import uuid
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable

from rich.console import Console

from reservoir.colocated import Colocated
from reservoir.config import RAY_OWN, ReservoirConfig
from reservoir.devices import gpus_wanted
from reservoir.errors import Abandoned, ConfigError, ReservoirError
from reservoir.explorer.evaluate import held_out_accuracy
from reservoir.explorer.worker import ExplorerStats, ExplorerWorker
from reservoir.explorer.workflow import make_workflow
from reservoir.http import check_free, run_app, url_of
from reservoir.logs import Relay, replay, say, warn
from reservoir.monitor import Monitor, live
from reservoir.pipeline.stream import PipelineWorker, stream_spec
from reservoir.plan.weights import branch_checkpoint, check_model
from reservoir.prepare import absolute, ensure_run
from reservoir.servers import routed
from reservoir.store import Store
from reservoir.trainer.worker import RunSummary, TrainerWorker
from reservoir.plan.stages import total_steps

EXPLORER_RESTARTS = 3  # Ray restarts a dead explorer actor this often, and calls its run again
DRIVER = "reservoir"   # the driver's own log lines' worker
STOPPING = "stopping: workers finish their step and checkpoint (Ctrl-C again to abort)"


def run(config: ReservoirConfig, *, resume: bool = False, console: Console | None = None,
        view: bool = True) -> RunSummary:
    """Trainer and explorer pools on Ray, until the trainer is done or Ctrl-C; a colocated
    run is one process (`train`). `view`: the live table (else only the log lines)."""
    if config.run.placement == "colocated":
        return train(config, resume=resume, console=console, view=view)
    import ray

    from reservoir.report import write_report  # the trackers take the run's plots at its end

    console = console or Console()
    config = _prepared(config)
    with Store.open(config, migrate=True) as store:
        ensure_run(store, config, resume=resume)  # a refusal comes before Ray starts
        with _ray(config) as relay:
            gpus = gpu_shares(config, ray.cluster_resources().get("GPU", 0))
            config = _ray_devices(config, gpus)
            _check_placeable(config)
            trainer = _actor(TrainerWorker, gpus=gpus["trainer"],
                             resources=config.trainer.resources).remote(
                config, resume=resume, evaluate=partial(held_out_accuracy, config),
                report=write_report, relay=relay.name)
            explorers = [_actor(ExplorerWorker, EXPLORER_RESTARTS, gpus["explorer"],
                                config.explorer.resources).remote(
                config, index, relay=relay.name) for index in range(config.explorer.workers)]
            streams = [_actor(PipelineWorker, EXPLORER_RESTARTS).remote(
                config, path, [config.run.name], relay=relay.name) for path in config.pipelines]
            workers = [trainer, *explorers, *streams]
            done, explored = trainer.run.remote(), [w.run.remote() for w in explorers]
            streamed = [w.run.remote() for w in streams]
            _supervise(Monitor(store, config.run.name, total_steps(config)), console,
                       finished=lambda wait: bool(ray.wait([done], timeout=wait)[0]),
                       stop=lambda: [w.request_stop.remote() for w in workers],
                       drain=relay.drain, view=view)
            try:
                summary = _unwrap(lambda: _trainer_result(done, store, config.run.name))
            finally:  # its explorers and streams would wait for a failed trainer to resume
                relay.drain()
                for worker in workers[1:]:
                    worker.request_stop.remote()
            _report(explored + streamed)
            relay.drain()
    return summary


def _trainer_result(done, store: Store, run: str) -> RunSummary:
    """The trainer's summary; its actor lost (its node gone, its process killed): the run is
    marked failed and stops with one line (ReservoirError) saying how to continue it."""
    import ray

    try:
        return ray.get(done)
    except ray.exceptions.RayActorError as exc:
        store.runs.set_status(store.run_id(run), "failed")
        cause = " ".join(str(exc).split())
        cause = "its node was lost" if "node" in cause.lower() else "its process died"
        raise ReservoirError(
            f"run {run!r}: the trainer's Ray actor is gone ({cause}); the run is stopped at its "
            "last committed step: continue it on any node that sees trainer.checkpoint_dir "
            "with `reservoir run CONFIG --resume`") from None


def _report(refs: list) -> None:
    """One line per explorer or pipeline worker; one that failed for good is reported, not
    raised (the run is the trainer's: it finished)."""
    import ray

    deadline = time.monotonic() + 120  # for them all: an actor never placed waits no longer
    for ref in refs:
        try:
            stats = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            warn(DRIVER, f"a worker ended with an error: {str(exc).splitlines()[0]}")
            continue
        if isinstance(stats, ExplorerStats):
            say(DRIVER, stats.line())
        else:
            say(DRIVER, f"pipeline {stats.pipeline!r}: {stats.passes} passes, "
                        f"{stats.rows_in} rows in, {stats.rows_out} passed")


def explore(config: ReservoirConfig, *, console: Console | None = None,
            view: bool = True) -> list[ExplorerStats]:
    """Explorers only: one in this process, or a Ray pool of explorer.workers."""
    if config.run.placement == "colocated":
        raise ConfigError("run.placement is colocated: its trainer explores in its own "
                          "process; start the run with `reservoir run` (or `reservoir train`)")
    console = console or Console()
    config = _prepared(config)
    with Store.open(config, migrate=True) as store:
        ensure_run(store, config)
        monitor = Monitor(store, config.run.name, total_steps(config))
        if config.explorer.workers == 1:
            return [_in_front(ExplorerWorker(config), monitor, console, view)]
        import ray

        with _ray(config) as relay:
            gpus = gpu_shares(config, ray.cluster_resources().get("GPU", 0), trainer=False)
            config = _ray_devices(config, gpus)
            workers = [_actor(ExplorerWorker, EXPLORER_RESTARTS, gpus["explorer"]).remote(
                config, index, relay=relay.name) for index in range(config.explorer.workers)]
            explored = [w.run.remote() for w in workers]
            _supervise(monitor, console,
                       finished=lambda wait: len(ray.wait(explored, num_returns=len(explored),
                                                          timeout=wait)[0]) == len(explored),
                       stop=lambda: [w.request_stop.remote() for w in workers],
                       drain=relay.drain, view=view)
            try:
                return _unwrap(lambda: ray.get(explored))
            finally:
                relay.drain()


def train(config: ReservoirConfig, *, resume: bool = False, console: Console | None = None,
          view: bool = True) -> RunSummary:
    """The trainer only, in this process (with its explorer, in a colocated run)."""
    from reservoir.report import write_report  # the trackers take the run's plots at its end

    console = console or Console()
    config = _prepared(config)
    if config.serve is not None and config.run.placement == "colocated":
        check_free(config.serve.host, config.serve.port, "serve.port")
    with Store.open(config, migrate=True) as store:
        ensure_run(store, config, resume=resume)
        monitor = Monitor(store, config.run.name, total_steps(config))
        colocate = Colocated if config.run.placement == "colocated" else None
        trainer = TrainerWorker(config, resume=resume, evaluate=partial(held_out_accuracy, config),
                                colocate=colocate, report=write_report)
        return _in_front(trainer, monitor, console, view)


def serve(config: ReservoirConfig, *, console: Console | None = None) -> None:
    """`reservoir serve`: the OpenAI-compatible endpoint, until Ctrl-C."""
    from reservoir.explorer.serve import Server, create_app

    if config.run.placement == "colocated":
        raise ConfigError("run.placement is colocated: its trainer's process serves the "
                          "endpoint (serve: in its config); start the run with `reservoir run` "
                          "(or `reservoir train`)")
    console = console or Console()
    config = _prepared(config)
    check_free(config.serve.host, config.serve.port, "serve.port")
    with Store.open(config, migrate=True) as store:
        ensure_run(store, config)
    server = Server(config)
    try:
        host, port = config.serve.host, config.serve.port
        version = ("none published yet" if server.version is None
                   else f"version {server.version}")
        console.print(f"serving run {config.run.name!r} as model {server.model!r} (policy "
                      f"{version}) at {url_of(host, port)}/v1"
                      f"{' (bearer token required)' if server.token else ''}; Ctrl-C stops",
                      markup=False, highlight=False, soft_wrap=True)
        run_app(create_app(server), host, port)
    finally:
        server.close()


def _prepared(config: ReservoirConfig) -> ReservoirConfig:
    """Paths absolute, and every file the run will need checked before anything starts: the
    model folder, the task file, each stream pipeline."""
    config = absolute(config)
    check_model(config)
    if config.branch is not None:
        branch_checkpoint(config)
    if config.tasks.file is not None and not Path(config.tasks.file).exists():
        raise ConfigError(f"tasks.file: {config.tasks.file} does not exist (a task file, a "
                          "folder of shards or a datasets folder)")
    for index, path in enumerate(config.pipelines):
        stream_spec(path, index)
    make_workflow(config.explorer.workflow, config.explorer.workflow_options)
    return routed(config, create=True)  # store.urls: the config on the run's server


def _in_front(worker, monitor: Monitor, console: Console, view: bool):
    """worker.run() in this thread while a helper thread shows the run; its result. Torch
    computes here: on a CPU a second thread's OpenMP team measurably slowed a colocated step
    (generation and training ~1.4x slower than the same calls in the main thread). The first
    Ctrl-C asks the worker to stop (it finishes its step and checkpoints); a second raises
    `Abandoned` where the worker is: it stops at once."""
    stopping, done = threading.Event(), threading.Event()

    def interrupted(signum, frame) -> None:
        if stopping.is_set():
            raise Abandoned("interrupted")
        stopping.set()
        worker.request_stop()

    here = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupted) if here else None
    viewer = threading.Thread(target=_show, args=(monitor, console, done, stopping, view),
                              name="monitor", daemon=True)
    viewer.start()
    try:
        return worker.run()
    finally:
        if here:
            signal.signal(signal.SIGINT, previous)
        done.set()
        viewer.join()


def _show(monitor: Monitor, console: Console, done: threading.Event,
          stopping: threading.Event, view: bool) -> None:
    """Refresh the live view every half second until `done`; say so once a stop was asked."""
    said = False
    with live(monitor, console, view) as refresh:
        while not done.wait(0.5):
            if stopping.is_set() and not said:
                said = True
                say(DRIVER, STOPPING)
            refresh()


def _supervise(monitor: Monitor, console: Console, *, finished: Callable[[float], bool],
               stop: Callable[[], object], drain: Callable[[], None], view: bool) -> None:
    """Refresh the live view and pass the workers' lines on until `finished`; the first
    Ctrl-C calls `stop` and keeps waiting."""
    stopping = False
    with live(monitor, console, view) as refresh:
        while True:
            try:
                drain()
                if finished(0.5):
                    return
                refresh()
            except KeyboardInterrupt:
                if stopping:
                    raise
                stopping = True
                stop()
                say(DRIVER, STOPPING)


def _actor(cls, restarts: int = 0, gpus: float = 0, resources: dict | None = None):
    """The class as a Ray actor that takes request_stop while run() goes on; Ray shows it only
    the GPUs it declares (none: CUDA_VISIBLE_DEVICES is empty) and places it on a node with the
    custom `resources` it asks for. A restartable one (explorers, streams) that dies, with its
    node say, is started again up to `restarts` times, on any node that fits, and its run()
    is called again there however long that takes (Ray retries a call only for a lost actor,
    never for an error of ours); until then the trainer waits for rows, up to
    trainer.wait_timeout_s."""
    import ray

    return ray.remote(num_cpus=0, num_gpus=gpus, resources=resources or None,
                      max_concurrency=2, max_restarts=restarts,
                      max_task_retries=-1 if restarts else 0)(cls)


def _check_placeable(config: ReservoirConfig) -> None:
    """A line for each role whose custom resources no live node offers now: its actors wait
    for such a node (one an autoscaler adds, or a typo: the line says which)."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for key, wanted in (("trainer.resources", config.trainer.resources),
                        ("explorer.resources", config.explorer.resources)):
        if wanted and not any(all(node.get(name, 0) >= amount for name, amount in wanted.items())
                              for node in nodes):
            offered = sorted({name for node in nodes for name in node
                              if name not in RAY_OWN
                              and not name.startswith(("node:", "accelerator_type:"))})
            warn(DRIVER, f"{key}: no node of the Ray cluster offers {wanted} now (its nodes "
                         f"offer {', '.join(offered) or 'no custom resources'}); the actors "
                         "wait for one (ray start --resources, or an autoscaler)")


def gpu_shares(config: ReservoirConfig, available: float, *,
               trainer: bool = True) -> dict[str, float]:
    """GPUs each trainer and explorer actor declares. When the cluster has fewer GPUs than they
    ask for together, each gets a fraction, so Ray puts them on the same devices (in sync mode
    the trainer and explorers take turns on one GPU)."""
    wanted = {"trainer": gpus_wanted(config.trainer.device, config.trainer.workers)
              if trainer else 0,
              "explorer": gpus_wanted(config.explorer.device)}
    total = wanted["trainer"] + wanted["explorer"] * config.explorer.workers
    if total <= available:
        return wanted
    if max(wanted.values()) > 1 or available < 1:  # Ray splits only single GPUs
        raise ConfigError(f"trainer.device / explorer.device: the trainer and explorers need "
                          f"{total:g} GPUs together and the Ray cluster has {available:g}; add "
                          "GPUs, or run the explorers on cpu")
    per_gpu = math.ceil(total / int(available))  # actors that share one device
    return {role: gpus / per_gpu for role, gpus in wanted.items()}


def _ray_devices(config: ReservoirConfig, gpus: dict[str, float]) -> ReservoirConfig:
    """Inside an actor Ray numbers its GPUs from 0: cuda:N becomes cuda."""
    update = {role: getattr(config, role).model_copy(update={"device": "cuda"})
              for role in ("trainer", "explorer")
              if gpus[role] and getattr(config, role).device.startswith("cuda")}
    return config.model_copy(update=update)


class _ray:
    """ray.init for the pools (local unless run.ray_address), shut down afterwards; the
    workers' lines come through a relay actor (reservoir.logs), not Ray's echo of their
    output."""

    def __init__(self, config: ReservoirConfig) -> None:
        self.address, self.actor = config.run.ray_address, None
        self.name = f"reservoir-logs-{uuid.uuid4().hex[:12]}"  # the relay's, for the workers

    def __enter__(self) -> "_ray":
        import ray

        logging.getLogger("ray").propagate = True  # Ray's warnings: lines of ours (logs.output)
        ray.init(address=self.address, include_dashboard=False, configure_logging=False,
                 log_to_driver=False)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actor = ray.remote(num_cpus=0)(Relay).options(  # on the driver's node: it lives
            name=self.name, scheduling_strategy=here).remote()  # as long as the driver does
        return self

    def drain(self) -> None:
        """Pass the lines the workers said since the last drain on, in the driver."""
        import ray

        replay(ray.get(self.actor.take.remote(), timeout=60))

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()


def _unwrap(get: Callable):
    """ray.get, with our own errors raised as themselves rather than wrapped by Ray."""
    from ray.exceptions import RayTaskError

    try:
        return get()
    except RayTaskError as exc:
        if isinstance(exc.cause, ReservoirError):
            raise exc.cause from None
        raise
