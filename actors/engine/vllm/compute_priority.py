"""On a CPU host, vLLM's compute threads yield to the serving path: they run at a higher nice value.

With one core per engine and every process of the service on the same few
cores, each engine's worker computes flat out on its core while the processes
that carry requests (the HTTP proxy, the ingress, the engine actors, vLLM's
engine cores) need that same core for a few hundred microseconds at a time.
At equal priority each of those short wake-ups waits behind the compute, hop
after hop, and a request's first bytes take seconds to reach the engine under
load (the trace's client -> front and response -> client hops). At nice
`compute_nice` (default 10) the worker still gets every cycle nobody else
wants, but the serving path runs first. Nice is per thread on Linux: every
thread of each `VLLM::Worker` process below the engine actor is set (threads
created later inherit it); an engine whose core runs the model itself (vLLM's uni
executor, `actors.engine.vllm.uniproc`) has no worker: its `VLLM::EngineCore` is set. GPU hosts are left alone (the compute is not on the
CPU there, and a worker's CPU threads launch the kernels).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("raypd.vllm")


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def lower_compute_priority(nice: int, root_pid: int | None = None) -> list[int]:
    """Set every thread of the vLLM processes that run the model below `root_pid` (this process) to `nice`;
    the pids set. A no-op (returns []) with nice 0 or off vLLM's CPU platform."""
    if nice <= 0:
        return []
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        import psutil

        kids = psutil.Process(root_pid or os.getpid()).children(recursive=True)
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
            done.append(pid)
        except (OSError, ValueError) as exc:
            logger.info("could not lower the priority of vLLM process %s: %s", pid, exc)
    if done:
        logger.info("vLLM processes %s compute at nice %d (the serving path runs first)", done, nice)
    return done
