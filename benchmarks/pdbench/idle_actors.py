#!/usr/bin/env python
"""The idle-cost reference: bare Ray actors in the same cluster as raypd's actors.

  python benchmarks/pdbench/idle_actors.py GCS_ADDRESS

Joins the cluster `raypd up` started, creates one bare sync actor and one bare
async actor (an event loop, like raypd's EngineActor), both `num_cpus=0`, prints
`PIDS <sync> <async>` and keeps them alive until its stdin closes; they end
with this driver.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import ray

    ray.init(address=sys.argv[1], namespace="raypd-bench-idle", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class BareActor:
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class BareAsyncActor:
        async def pid(self) -> int:
            return os.getpid()

    sync_actor, async_actor = BareActor.remote(), BareAsyncActor.remote()
    pids = ray.get([sync_actor.pid.remote(), async_actor.pid.remote()])
    print("PIDS", *pids, flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
