"""Past one node: runs spread over PostgreSQL servers, measured here and simulated at scale.

(a) measured: K PostgreSQL servers stand in for K store nodes (embedded servers started on this
    machine, or `--urls` of real ones). R runs, one process each, as an explorer and a trainer
    of that run would: it writes its rows through `Store.write_groups`, then leases and commits
    them all through `Store.lease` + `Store.commit_step`, the R processes in step (a barrier
    before each phase). The same runs are placed three ways: all on one server; over the K
    servers by a hash of the run's name (placement that needs no table); and through
    `store.urls` as `reservoir run` places them (each process routes its config with
    `servers.routed`: run_servers on the first server, least declared demand). After each
    round every run is checked on its server (all rows consumed, a ledger row each, on no other
    server) and deleted with its placement. Printed: rows/s of all processes together per
    phase, and against one server the median of the repeats' own ratios.
(b) simulated: a cluster of G GPUs, each generating `--rollouts-per-gpu` rows/s, split into runs
    of 8 to 256 GPUs (drawn at random; a writer and a lessee process per host of 8 GPUs),
    placed over N store nodes by hash of name, by least demand, or least demand with runs too
    big for a node sharded by group. A node's capacity comes from measured figures: its write
    and lease + commit rows/s for w processes (`C(w) = Cmax (1 - (1 - C1/Cmax)^w)` through the
    one-process and saturated figures, bare asyncpg on a 16-core machine) times Reservoir's
    ratio to bare (bench/store.py); a row costs its node one write and one lease + commit out of
    the same WAL and CPU. Printed, over `--draws` random clusters: the share of generated rows
    the store keeps up with (median and 5th percentile), the busiest node's load, and the
    fewest nodes at which the 5th percentile keeps up with 99% of them.

    python bench/cluster.py                      # (a) on 2 embedded servers, then (b)
    python bench/cluster.py --urls URL1,URL2     # (a) on servers you run
    python bench/cluster.py --skip-measure       # (b) only
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from reservoir.config import ReservoirConfig, RunSection, SamplerConfig, StoreConfig
from reservoir.plan.urls import redact, server_key
from reservoir.servers import routed
from reservoir.store import Store, server
from reservoir.store.runs import delete_run

from store import make_pool, run_main, timed_leases, timed_writes  # bench/store.py

console = Console(width=None if sys.stdout.isatty() else 120)
PLACEMENTS = ("one server", "by hash", "store.urls")
POLICIES = ("by hash", "least demand", "sharded")
RUN_GPUS = (8, 16, 32, 64, 128, 256)  # run sizes drawn with equal chance
GPUS_PER_HOST = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=2, help="embedded servers to start for (a)")
    p.add_argument("--urls", help="comma-separated URLs of servers to use for (a) instead")
    p.add_argument("--runs", type=int, default=4, help="runs (processes) in (a)")
    p.add_argument("--rows-per-run", type=int, default=8192)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--write-batch-groups", type=int, default=64)
    p.add_argument("--batch", type=int, default=256, help="rows per lease")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-measure", action="store_true", help="run the simulation (b) only")
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rollouts-per-gpu", type=float, nargs="+", default=[25.0, 250.0],
                   help="rows/s a GPU generates (25: HF generate, 0.5B model, H200; 250: vLLM)")
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--node-write", type=float, nargs=2, default=[27_500, 61_000],
                   metavar=("ONE", "MAX"), help="a node's bare COPY rows/s: 1 writer, saturated")
    p.add_argument("--node-lease", type=float, nargs=2, default=[27_700, 70_000],
                   metavar=("ONE", "MAX"), help="a node's bare lease rows/s: 1 lessee, saturated")
    p.add_argument("--write-ratio", type=float, default=0.86, help="Reservoir / bare COPY")
    p.add_argument("--lease-ratio", type=float, default=0.88,
                   help="Reservoir lease+commit / bare lease")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    positive = {"--servers": args.servers, "--runs": args.runs, "--repeat": args.repeat,
                "--draws": args.draws, "--max-nodes": args.max_nodes,
                "--group-size": args.group_size, "--batch": args.batch,
                "--write-batch-groups": args.write_batch_groups}
    for flag, value in positive.items():
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    unit = math.lcm(args.batch, args.group_size * args.write_batch_groups)
    if args.rows_per_run < unit:
        p.error(f"--rows-per-run must be >= {unit} (whole write calls and leases)")
    args.rows_per_run -= args.rows_per_run % unit
    figures = [*args.node_write, *args.node_lease, args.write_ratio, args.lease_ratio,
               *args.rollouts_per_gpu, *args.gpus]
    if not all(math.isfinite(f) and f > 0 for f in figures):
        p.error("node figures, ratios, --gpus and --rollouts-per-gpu must be finite and > 0")
    if args.node_write[0] > args.node_write[1] or args.node_lease[0] > args.node_lease[1]:
        p.error("a node's one-process figure cannot exceed its saturated figure")
    if args.urls is not None:
        args.urls = [url.strip() for url in args.urls.split(",") if url.strip()]
        if not args.urls:
            p.error("--urls names no URL (give URL1,URL2,...)")
    return args


# --- (a) measured: runs placed over servers -------------------------------------------------


def place(run: str, n_servers: int) -> int:
    """The server of a run by a hash of its name: stable across processes and machines."""
    return int.from_bytes(hashlib.sha256(run.encode()).digest()[:8], "big") % n_servers


def run_config(urls: list[str], how: str, run: str) -> ReservoirConfig:
    """The run's config: on the first server, on its hash's server, or over `store.urls`
    (placed through run_servers by least declared demand when the run opens its store)."""
    sampler = SamplerConfig(unit="rows")
    if how == "store.urls":
        return ReservoirConfig(run=RunSection(name=run), store=StoreConfig(urls=urls),
                               sampler=sampler)
    url = urls[0] if how == "one server" else urls[place(run, len(urls))]
    return ReservoirConfig(run=RunSection(name=run), store=StoreConfig(url=url), sampler=sampler)


def _run_process(config: ReservoirConfig, rows: int, seed: int, args, barrier,
                 results) -> None:
    """One run: made where its config says (`servers.routed` for store.urls, as `reservoir
    run` does), its rows made (untimed), written all, then leased and committed all; each
    phase starts with the other runs' (a barrier) and its start and end times are reported."""
    run = config.run.name
    try:
        store = Store.open(routed(config, create=True), quiet=True, migrate=True)
        store.create_run(run, group_size=args.group_size)
        pool = make_pool(run, rows // args.group_size, args.group_size, seed)
        barrier.wait(timeout=600)
        write_start = time.time()
        timed_writes(store, pool.groups, args.write_batch_groups)
        write_end = time.time()
        barrier.wait(timeout=600)
        lease_start = time.time()
        timed_leases(store, run, rows // args.batch, args.batch, count(1))
        results.put((write_start, write_end, lease_start, time.time()))
        store.close()
    except Exception as exc:
        barrier.abort()
        results.put(f"run {run}: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:  # Ctrl-C reaches every process: the parent reports and cleans up
        pass


COUNTS = text("""
SELECT r.name, count(s.id) FILTER (WHERE s.status = 'consumed') AS consumed,
       (SELECT count(*) FROM batch_items b WHERE b.run_id = r.id) AS ledger
FROM runs r LEFT JOIN experience_state s ON s.run_id = r.id
WHERE r.name = ANY(:names) GROUP BY r.id, r.name
""")


def servers_of(urls: list[str], stores: list[Store], how: str, names: list[str]) -> list[int]:
    """Where each run went: read from run_servers for store.urls, else its config's server."""
    if how != "store.urls":
        return [urls.index(run_config(urls, how, name).store.url) for name in names]
    keys = [server_key(url) for url in urls]
    return [keys.index(stores[0].run_servers.server_of(name)) for name in names]


def check_runs(stores: list[Store], names: list[str], servers: list[int], rows: int) -> None:
    """Each run is on the server it was placed on, and only there, with all its rows consumed
    and a ledger row each."""
    for s, store in enumerate(stores):
        with store.engine.begin() as conn:
            found = {name: (consumed, ledger)
                     for name, consumed, ledger in conn.execute(COUNTS, {"names": names})}
        placed = {name for name, at in zip(names, servers) if at == s}
        if set(found) != placed or any(c != rows or n != rows for c, n in found.values()):
            raise SystemExit(f"server {s}: runs {sorted(placed)} placed, found (consumed, "
                             f"ledger rows) {found}; expected {rows:,} each")


def delete_runs(stores: list[Store], names: list[str]) -> None:
    """The runs of a round, wherever they got to (their partitions dropped), and where they
    were placed (the next round places them again)."""
    for store in stores:
        with store.engine.begin() as conn:
            there = conn.execute(text("SELECT name FROM runs WHERE name = ANY(:names)"),
                                 {"names": names}).scalars().all()
        for name in there:
            with store.engine.begin() as conn:
                delete_run(conn, name)
    for name in names:
        stores[0].run_servers.remove(name)


def measure_once(urls: list[str], stores: list[Store], how: str, names: list[str],
                 args) -> tuple[float, float, list[int]]:
    """(write rows/s, lease+commit rows/s, runs per server) of one placement, checked."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.runs), context.Queue()
    procs = [context.Process(target=_run_process, args=(
        run_config(urls, how, name), args.rows_per_run, args.seed * 1000 + i, args, barrier,
        results)) for i, name in enumerate(names)]
    try:
        for proc in procs:
            proc.start()
        times = [results.get(timeout=1200) for _ in procs]
        for proc in procs:
            proc.join()
        failed = [t for t in times if isinstance(t, str)]
        if failed:
            raise SystemExit(f"a run process failed: {failed[0]}")
        servers = servers_of(urls, stores, how, names)
        check_runs(stores, names, servers, args.rows_per_run)
    finally:
        for proc in procs:
            proc.join(timeout=30)
        delete_runs(stores, names)
    rows = args.rows_per_run * args.runs
    write = rows / (max(t[1] for t in times) - min(t[0] for t in times))
    lease = rows / (max(t[3] for t in times) - min(t[2] for t in times))
    return write, lease, [servers.count(s) for s in range(len(urls))]


def start_servers(n: int, root: Path) -> list[str]:
    urls = []
    for i in range(n):
        started = time.perf_counter()
        urls.append(server.start(root / f"node{i}"))
        console.print(f"embedded server {i} started in {time.perf_counter() - started:.1f}s "
                      f"({root / f'node{i}'})")
    return urls


def measure(urls: list[str], args) -> None:
    # the schema on every server before anything is timed; these check and clean up after
    stores = [Store.open(ReservoirConfig(store=StoreConfig(url=url)), migrate=True, quiet=True)
              for url in urls]
    try:
        _measure(urls, stores, args)
    finally:
        for store in stores:
            store.close()


def _measure(urls: list[str], stores: list[Store], args) -> None:
    rates = {how: ([], []) for how in PLACEMENTS}
    spread = {}
    # the same names every round (each round deletes its runs), so a hash places them alike
    names = [f"cluster-{int(time.time())}-{i}" for i in range(args.runs)]
    for r in range(args.repeat):
        order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
        for how in order:
            write, lease, spread[how] = measure_once(urls, stores, how, names, args)
            rates[how][0].append(write)
            rates[how][1].append(lease)
            console.print(f"  repeat {r + 1}, {how} (runs per server {spread[how]}): write "
                          f"{write:,.0f} rows/s, lease+commit {lease:,.0f} rows/s")
    report_measured(rates, spread, len(urls), args)


def _against_one(rates: dict, how: str, k: int) -> tuple[float, str]:
    """The median of the repeats' own ratios to one server (each round ran minutes apart from
    its one-server round, so the machine's drift moves both), and their range."""
    ratios = [a / b for a, b in zip(rates[how][k], rates["one server"][k])]
    return statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}"


def report_measured(rates: dict, spread: dict, n_servers: int, args) -> None:
    table = Table(title=f"(a) {args.runs} runs x {args.rows_per_run:,} rows on {n_servers} "
                        f"servers, rows/s of all runs (median of {args.repeat}); against one "
                        "server: the median of the repeats' ratios, and their range")
    for name in ("placement", "runs per server", "write", "vs one server", "lease+commit",
                 "vs one server"):
        table.add_column(name, justify="left" if name == "placement" else "right")
    lines = []
    for how in PLACEMENTS:
        write, lease = (statistics.median(rates[how][k]) for k in (0, 1))
        (w_ratio, w_range), (l_ratio, l_range) = (_against_one(rates, how, k) for k in (0, 1))
        table.add_row(how, str(spread[how]), f"{write:,.0f}", f"{w_ratio:.2f} ({w_range})",
                      f"{lease:,.0f}", f"{l_ratio:.2f} ({l_range})")
        lines.append(f"{how} {spread[how]}: write {write:,.0f} rows/s ({w_ratio:.2f} of one "
                     f"server, {w_range}) | lease+commit {lease:,.0f} rows/s ({l_ratio:.2f}, "
                     f"{l_range})")
    console.print(table)
    for line in lines:
        print(line)


# --- (b) simulated: a cluster of runs over N nodes ------------------------------------------


@dataclass(frozen=True)
class NodeModel:
    """A node's rows/s against processes: C(w) = Cmax (1 - (1 - C1/Cmax)^w)."""

    write_one: float
    write_max: float
    lease_one: float
    lease_max: float

    @staticmethod
    def _curve(one: float, most: float, n: np.ndarray) -> np.ndarray:
        return most * (1.0 - (1.0 - one / most) ** n)

    def capacity(self, writers: np.ndarray, lessees: np.ndarray) -> np.ndarray:
        """Rows/s a node keeps up with when every row is written once and leased once: the two
        share its WAL and CPU, so the times add. A node with nothing placed has capacity 0."""
        write = self._curve(self.write_one, self.write_max, writers)
        lease = self._curve(self.lease_one, self.lease_max, lessees)
        with np.errstate(divide="ignore", invalid="ignore"):
            both = 1.0 / (1.0 / write + 1.0 / lease)
        return np.where((writers > 0) & (lessees > 0), both, 0.0)


@dataclass(frozen=True)
class Run:
    name: str
    gpus: int


def draw_runs(rng: np.random.Generator, gpus: int) -> list[Run]:
    """Runs of 8 to 256 GPUs until `gpus` are used (the last one takes what is left)."""
    runs, left = [], gpus
    while left > 0:
        size = min(int(rng.choice(RUN_GPUS)), left)
        runs.append(Run(f"run-{rng.integers(1 << 62):x}", size))
        left -= size
    return runs


def processes(gpus: int) -> int:
    """Writer processes of a run (or shard), and as many lessees: one each per host of 8 GPUs."""
    return math.ceil(gpus / GPUS_PER_HOST)


def shards(run: Run, rate: float, model: NodeModel) -> list[Run]:
    """A run split by group into the fewest shards that a node of its own each keeps up with
    (each shard with its share of the run's writers and lessees); a run that fits stays whole."""
    for n in range(1, processes(run.gpus) + 1):
        size = math.ceil(run.gpus / n)
        alone = np.array([processes(size)])
        if size * rate <= model.capacity(alone, alone)[0]:
            break
    sizes = [len(part) for part in np.array_split(np.arange(run.gpus), n)]
    return [Run(f"{run.name}/{i}", size) for i, size in enumerate(sizes)]


def assign(runs: list[Run], policy: str, nodes: int, rate: float) -> list[tuple[Run, int]]:
    """Runs (for "sharded", already split by `shards`) placed over `nodes` nodes."""
    if policy == "by hash":
        return [(run, place(run.name, nodes)) for run in runs]
    demand = np.zeros(nodes)
    placed = []
    for run in runs:  # in the order they start: each to the node with the least demand yet
        node = int(np.argmin(demand))
        demand[node] += run.gpus * rate
        placed.append((run, node))
    return placed


def simulate(placed: list[tuple[Run, int]], nodes: int, rate: float,
             model: NodeModel) -> tuple[float, float]:
    """(share of generated rows/s the store keeps up with, the busiest node's demand over its
    capacity)."""
    demand, writers, lessees = np.zeros(nodes), np.zeros(nodes), np.zeros(nodes)
    for run, node in placed:
        demand[node] += run.gpus * rate
        writers[node] += processes(run.gpus)
        lessees[node] += processes(run.gpus)
    capacity = model.capacity(writers, lessees)
    kept = np.minimum(demand, capacity).sum() / demand.sum()
    busy = demand > 0
    return float(kept), float((demand[busy] / capacity[busy]).max())


def simulate_cluster(args) -> None:
    model = NodeModel(args.node_write[0] * args.write_ratio, args.node_write[1] * args.write_ratio,
                      args.node_lease[0] * args.lease_ratio, args.node_lease[1] * args.lease_ratio)
    saturated = float(model.capacity(np.array([1e6]), np.array([1e6]))[0])
    console.print(f"(b) node model: Reservoir writes {model.write_one:,.0f} rows/s with 1 writer, "
                  f"{model.write_max:,.0f} saturated; leases + commits {model.lease_one:,.0f} / "
                  f"{model.lease_max:,.0f}; a row written and trained: {saturated:,.0f} rows/s a "
                  "node at most", highlight=False)
    rng = np.random.default_rng(args.seed)
    for gpus in args.gpus:
        for rate in args.rollouts_per_gpu:
            clusters = [draw_runs(rng, gpus) for _ in range(args.draws)]
            simulate_scenario(clusters, gpus, rate, model, saturated, args)


def simulate_scenario(clusters: list[list[Run]], gpus: int, rate: float, model: NodeModel,
                      saturated: float, args) -> None:
    """Every node count from the fewest that could hold the demand up to --max-nodes, each
    placement policy; shown: the fewest, each policy's nodes needed, and twice the fewest."""
    demand = gpus * rate
    fewest = min(args.max_nodes, max(1, math.ceil(demand / saturated)))
    split = [[part for run in runs for part in shards(run, rate, model)] for runs in clusters]
    placed_runs = {"by hash": clusters, "least demand": clusters, "sharded": split}
    results, needed = {}, {}
    for nodes in range(fewest, args.max_nodes + 1):
        for policy in POLICIES:
            outcomes = [simulate(assign(runs, policy, nodes, rate), nodes, rate, model)
                        for runs in placed_runs[policy]]
            kept = [k for k, _ in outcomes]
            results[nodes, policy] = (statistics.median(kept), float(np.percentile(kept, 5)),
                                      statistics.median(b for _, b in outcomes))
            if results[nodes, policy][1] >= 0.99:
                needed.setdefault(policy, nodes)
        if len(needed) == len(POLICIES):
            break
    table = Table(title=f"(b) {gpus:,} GPUs x {rate:g} rows/s = {demand:,.0f} rows/s, "
                        f"{len(clusters)} random clusters (runs of {RUN_GPUS[0]}-{RUN_GPUS[-1]} "
                        "GPUs)")
    for name in ("nodes", "placement", "kept up, median", "kept up, p5", "busiest node, median"):
        table.add_column(name, justify="left" if name == "placement" else "right")
    last = max(n for n, _ in results)
    for nodes in sorted({fewest, *needed.values(), min(2 * fewest, last), last}):
        for policy in POLICIES:
            median, p5, busiest = results[nodes, policy]
            table.add_row(str(nodes), policy, f"{median:.1%}", f"{p5:.1%}", f"{busiest:.2f}")
    console.print(table)
    counts = ", ".join(f"{policy} {needed.get(policy, f'> {args.max_nodes}')}"
                       for policy in POLICIES)
    print(f"{gpus} GPUs x {rate:g} rows/s ({demand:,.0f} rows/s; {fewest} nodes at the least): "
          f"nodes for 99% kept up in 95% of clusters: {counts}")


def main() -> None:
    args = parse_args()
    if not args.skip_measure:
        if args.urls:
            console.print(f"(a) servers: {', '.join(redact(u) for u in args.urls)}")
            measure(args.urls, args)
        else:
            root = Path(tempfile.mkdtemp(prefix="reservoir-cluster-"))
            try:
                measure(start_servers(args.servers, root), args)
            finally:
                for i in range(args.servers):
                    server.stop(root / f"node{i}")
                shutil.rmtree(root, ignore_errors=True)
    simulate_cluster(args)


if __name__ == "__main__":
    try:
        run_main("cluster.py", main)
    except KeyboardInterrupt:
        raise SystemExit("bench/cluster.py: interrupted; its runs were deleted and any server "
                         "it started was stopped") from None
