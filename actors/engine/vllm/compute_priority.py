"""On a CPU host, vLLM's compute threads yield to the serving path: they run at a higher nice value.

With one core per engine and every process of the service on the same few
cores, each engine's worker computes flat out on its core while the processes
that carry requests (the HTTP proxy, the ingress, the engine actors, vLLM's
engine cores) need that same core for a few hundred microseconds at a time.
At equal priority each of those short wake-ups waits behind the compute, hop
after hop, and a request's first bytes take seconds to reach the engine under
load (the trace's client -> front and response -> client hops). At
`compute_nice` (default 10) above the engine actor's own nice value the worker
still gets every cycle nobody else wants, but the serving path runs first.
Relative, because Ray starts its workers at nice 15 (`RAY_worker_niceness`):
the Serve proxy, the ingress and the engine actors all run there, and an
absolute nice 10 would have put the compute *ahead* of them (as root; others
may not lower a nice value and the compute stayed level with them). The value
is capped at 19, the lowest priority. Under the kernel's autogroup the compute's session gets the same
value (`actors.engine.vllm.compute_group`). Nice is per thread on Linux: every
thread of each `VLLM::Worker` process below the engine actor is set (threads
created later inherit it); an engine whose core runs the model itself (vLLM's uni
executor, `actors.engine.vllm.uniproc`) has no worker: its `VLLM::EngineCore` is set. GPU hosts are left alone (the compute is not on the
CPU there, and a worker's CPU threads launch the kernels).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from actors.engine.vllm.compute_group import set_group_nice

logger = logging.getLogger("raypd.vllm")


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


MAX_NICE = 19  # Linux's lowest priority


def compute_nice_for(offset: int, own_nice: int) -> int:
    """The nice value of the compute: `offset` above its engine actor's own `own_nice`, at most 19."""
    return min(MAX_NICE, own_nice + offset)


def lower_compute_priority(offset: int, root_pid: int | None = None) -> list[int]:
    """Set every thread of the vLLM processes that run the model below `root_pid` (this process) to
    `offset` above this process's nice value (capped at 19); the pids set. A no-op (returns []) with
    offset 0, when this process already runs at 19, or off vLLM's CPU platform."""
    root = root_pid or os.getpid()
    own = os.getpriority(os.PRIO_PROCESS, root)  # the root's main thread (Ray sets the worker's there)
    nice = compute_nice_for(offset, own)
    if nice <= own:  # offset 0, or this process already at 19
        return []
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        import psutil

        kids = psutil.Process(root).children(recursive=True)
    except Exception as exc:  # noqa: BLE001 - best effort: the engine serves at equal priority
        logger.info("compute priority unchanged: %s", exc)
        return []
    titles = {proc.pid: _title(proc.pid) for proc in kids}
    computing = [pid for pid, t in titles.items() if t.startswith("VLLM::Worker")] or \
        [pid for pid, t in titles.items() if t.startswith("VLLM::EngineCore")]  # uni: the core computes
    done = []
    for pid in computing:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            set_group_nice(pid, nice)  # its session's group, under autogroup (compute_group.py)
            done.append(pid)
        except (OSError, ValueError) as exc:
            logger.info("could not lower the priority of vLLM process %s: %s", pid, exc)
    if done:
        logger.info("vLLM processes %s compute at nice %d, the engine actor at %d (the serving path runs first)",
                    done, nice, own)
    return done
