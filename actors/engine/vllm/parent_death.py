"""vLLM's processes of a raypd engine end when their parent does.

vLLM's engine core is a child process of the EngineActor (its workers children of the core), and
nothing in vLLM makes the core follow the actor. Ray's raylet SIGKILLs a dead worker's process
group, but not when it is gone too or that cleanup is off, nor for processes that left the group
(`compute_group`); then the core would keep its memory, KV cache and CPU. Invariant: whichever of
the raylet and this watch acts first, the core is gone (`orphans` reaps what escapes both on the
next start). How the watch works: `follow_parent`.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

PARENT_ENV = "RAYPD_ENGINE_ACTOR_PID"
GRACE_S = 5.0
CHECK_EVERY_S = 2.0

_following_in: int | None = None  # the pid whose thread follows (a forked child inherits the global, not the thread)


def child_env() -> dict[str, str]:
    """What the actor puts in the environment its vLLM processes inherit."""
    return {PARENT_ENV: str(os.getpid())}


def should_follow(env_value: str | None, pid: int) -> bool:
    """A process spawned below a raypd engine actor (marked, and not the actor itself)."""
    return bool(env_value) and env_value != str(pid)


def follow_parent(grace_s: float = GRACE_S, check_every_s: float = CHECK_EVERY_S) -> threading.Thread | None:
    """In a vLLM process: end when the parent does. The watching thread,
    or None when this process is not below a raypd engine actor (or already follows).

    How: the actor names itself in its environment (`PARENT_ENV`) before vLLM spawns the core, so every
    vLLM process below it inherits the mark. raypd's vLLM plugin (`actors.engine.vllm.plugin`) calls
    `follow_parent` in each vLLM process it is loaded in; a marked process that is not the actor itself
    opens a pidfd on its parent and one daemon thread blocks in poll() on it. The poll also wakes every
    `CHECK_EVERY_S` to compare `os.getppid()` with the parent: a kernel or sandbox without pidfds, or
    whose pidfds never signal, still notices the re-parenting within that time (one wake-up per few
    seconds; no CPU in between). When the parent exits, the process sends itself SIGTERM (vLLM's handler
    shuts the core down and cleans its shared memory), then SIGKILL `grace_s` later if it is still alive.
    A parent already gone when it is checked (re-parented) counts the same.
    """
    global _following_in
    if _following_in == os.getpid() or not should_follow(os.environ.get(PARENT_ENV), os.getpid()):
        return None
    parent = os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3) or the parent is gone already
        pidfd = None
    if parent == 1 or os.getppid() != parent:  # re-parented before the pidfd named the right process
        _stop_self(parent, grace_s)
        return None
    thread = threading.Thread(target=_wait_then_stop, args=(pidfd, parent, grace_s, check_every_s),
                              name="raypd-follow-parent", daemon=True)
    thread.start()
    _following_in = os.getpid()
    return thread


def _wait_then_stop(pidfd: int | None, parent: int, grace_s: float, check_every_s: float) -> None:
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    while not poller.poll(check_every_s * 1000) and os.getppid() == parent:
        pass  # woken by the pidfd (the parent exited) or the timeout (re-parented?)
    _stop_self(parent, grace_s)


def _stop_self(parent: int, grace_s: float) -> None:
    if os.getsid(0) == os.getpid():
        # it left the actor's process group (actors.engine.vllm.compute_group), so the raylet's
        # cleanup, which SIGKILLs that group, cannot reach it: it does the same, at once
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        print(f"raypd: the parent (pid {parent}) of vLLM process {os.getpid()} exited; stopping it",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr was the dead parent's pipe, or closed: stop all the same
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
