"""A trainer stand-in in its own process: lease batches, print their ids, commit or hold.

    python -m tests.workers.lease_worker URL RUN WORKER_INDEX BATCH commit|hold LEASE_SECONDS

`commit` leases until nothing is left, committing each batch as a step; `hold` leases one
batch, prints it and sleeps (to be killed while holding the lease). The worker prints "ready"
once connected and starts when a line arrives on standard input, so several start together.
"""

import json
import sys
import time

from reservoir.config import SamplerConfig
from reservoir.errors import FlowControlTimeout
from reservoir.store import Store


def main() -> None:
    url, run, index, batch, mode, lease_seconds = sys.argv[1:7]
    flow = SamplerConfig(unit="rows", lease_seconds=float(lease_seconds), wait_timeout_s=0.5)
    with Store(url, flow) as store:
        store.reclaim_expired()  # connect before the start line
        print("ready", flush=True)
        sys.stdin.readline()
        step = int(index) * 100_000
        while True:
            try:
                lease = store.lease(run, rows=int(batch), allow_partial=True)
            except FlowControlTimeout:
                return
            print(json.dumps(lease.ids), flush=True)
            if mode == "hold":
                time.sleep(3600)
            step += 1
            store.commit_step(lease, step=step, policy_version=0)


if __name__ == "__main__":
    main()
