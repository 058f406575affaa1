"""On a CPU host, vLLM's compute threads yield to the serving path: they run at a higher nice value.

With every process of the service on the same few cores, each engine's worker computes flat out
while the processes that carry requests (proxy, ingress, engine actors, vLLM's engine cores) need
that core for short wake-ups; at equal priority each waits behind the compute, hop after hop. At
`compute_nice` above the engine actor's own nice value (relative: Ray starts its workers at nice
15; capped at 19) the worker still gets every cycle nobody else wants, but the serving path runs
first. Nice is per thread: every thread of each `VLLM::Worker` below the engine actor is set (or
its `VLLM::EngineCore` under the uni executor); under autogroup its session too (`compute_group`).
GPU hosts are left alone.
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
