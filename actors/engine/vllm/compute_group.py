"""On a CPU host whose kernel groups processes by session (autogroup), vLLM's compute gets a group of its own.

Linux's `sched_autogroup_enabled` (on by default in most distributions' kernels, and on this
project's CI machines) schedules each session as one group: CPU is shared fairly between
sessions, and a thread's nice value only ranks it inside its own session. `raypd up` starts
Ray in one session, so the compute (nice 19, `actors.engine.vllm.compute_priority`), the
serving path and Ray's own processes form one group, and any other session on the host (a
client, a shell, a monitoring agent) competes with that group as a whole, whatever the
compute's nice value says. Measured on the 2-core box with `benchmarks/pd_vs_vllm.py`'s (e0)
under load: a nice-0 process in the client's session was runnable but not run for up to
5.6 s at a time (its schedstat wait time) while the two engine cores computed, and every
open stream and every new request of the benchmark's client stalled with it (client ->
front hop p90 up to 1.1 s, max 3.1 s). With autogroup off the same run had none (max 39 ms).

So each vLLM process below a raypd engine on such a host leaves its parent's session when it
starts (`leave_session`, from raypd's vLLM plugin), and the engine actor gives the group of
each process that computes the compute's nice value (`set_group_nice`, from
`lower_compute_priority`): the compute then takes what every other session leaves, as the
nice value meant. Nothing changes without autogroup (the nice values already rank every
thread on the host), on GPU hosts, or for a process that is not below a raypd engine.

Cost: the raylet's process-group cleanup (`RAY_process_group_cleanup_enabled`) no longer
reaches a core that left the group; `actors.engine.vllm.parent_death` does the same when its
parent dies (SIGKILL at once: a CI run saw a core that was sent SIGTERM still alive 7 s after its
actor's kill -9, when the restarted engine started).
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
