"""On a CPU host whose kernel groups processes by session (autogroup), vLLM's compute gets a group of its own.

With `sched_autogroup_enabled` each session is one scheduling group: a thread's nice value only ranks
it inside its own session. `raypd up` starts Ray in one session, so the compute (nice 19,
`actors.engine.vllm.compute_priority`) would compete with every other session on the host (a client,
a shell) as one group, whatever its nice value says, and stall them (docs/benchmarks.md).
So each vLLM process below a raypd engine leaves its parent's session when it starts
(`leave_session`, from raypd's vLLM plugin), and the engine actor gives each computing process's
group the compute's nice value (`set_group_nice`). Nothing changes without autogroup, on GPU hosts,
or for a process not below a raypd engine. Cost: the raylet's process-group cleanup no longer
reaches such a core; `actors.engine.vllm.parent_death` stops it when its parent dies.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("raypd.vllm")

AUTOGROUP_SYSCTL = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup_enabled(sysctl: Path = AUTOGROUP_SYSCTL) -> bool:
    try:
        return sysctl.read_text().strip() == "1"
    except OSError:  # no such kernel option
        return False


def leave_session(on_cpu: bool, sysctl: Path = AUTOGROUP_SYSCTL) -> bool:
    """In a vLLM process below a raypd engine: start a session (and so a scheduling group) of its
    own on a CPU host with autogroup. True when it did."""
    if not on_cpu or not autogroup_enabled(sysctl):
        return False
    try:
        os.setsid()
    except OSError:  # already a process-group leader: stays where it is
        return False
    return True


def set_group_nice(pid: int, nice: int, proc: Path = Path("/proc")) -> bool:
    """Give the scheduling group of `pid` the nice value `nice` when `pid` leads a session of its own
    (`leave_session`); True when it did."""
    try:
        if os.getsid(pid) != pid:
            return False
        (proc / str(pid) / "autogroup").write_text(str(nice))
    except OSError as exc:  # gone, no autogroup, or not allowed: its threads' nice still applies
        logger.info("could not set the scheduling group of vLLM process %s to nice %d: %s", pid, nice, exc)
        return False
    return True
