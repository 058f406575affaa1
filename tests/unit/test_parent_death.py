"""A process below a raypd engine actor ends when its parent does (actors.engine.vllm.parent_death), with
real processes: a stand-in actor that marks its environment and spawns a child which calls
`follow_parent`, as vLLM's engine core does through raypd's plugin; the stand-in is then killed -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from actors.engine.vllm import parent_death

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The child: follows its parent (the mark is inherited), says so, then idles as a core would between
# requests. Its SIGTERM handler records that it was asked to stop before it exits (grace 0.5 s: it
# ignores SIGTERM, as a core stuck outside Python would).
# With "nopidfd" it has no pidfd_open (a kernel before 5.3, a sandbox that refuses it) and notices the
# re-parenting by its periodic check alone.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from actors.engine.vllm.parent_death import follow_parent
    if sys.argv[1] == "0.5":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: (print("sigterm", flush=True), sys.exit(0)))
    if sys.argv[2].startswith("nopidfd"):
        del os.pidfd_open
    following = follow_parent(grace_s=float(sys.argv[1]), check_every_s=0.5)
    if sys.argv[2].endswith("setsid"):
        os.setsid()  # as raypd's plugin does under autogroup (compute_group.leave_session)
    print("following" if following else "not following", flush=True)
    time.sleep(600)
""")

# The stand-in actor: the mark (or none), the child, the child's pid and first line on stdout, then idle.
ACTOR = textwrap.dedent("""
    import os, subprocess, sys, time
    from actors.engine.vllm.parent_death import child_env
    env = dict(os.environ, **child_env()) if sys.argv[1] == "mark" else dict(os.environ)
    log = open(sys.argv[3], "w")
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[4], sys.argv[5]], env=env, stdout=log)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _start(mark: bool, tmp_path, grace_s: float = 5.0, pidfd: bool = True, own_session: bool = False
           ) -> tuple[subprocess.Popen, psutil.Process, str]:
    log = str(tmp_path / "child.log")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(parent_death.PARENT_ENV, None)
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, "mark" if mark else "none", CHILD, log, str(grace_s),
                              ("pidfd" if pidfd else "nopidfd") + ("-setsid" if own_session else "")],
                             env=env, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(actor.stdout.readline()))
    deadline = time.monotonic() + 30
    while "following" not in open(log).read():
        assert time.monotonic() < deadline, "the child never said whether it follows"
        time.sleep(0.05)
    return actor, child, log


def _ended_after(proc: psutil.Process, t0: float, timeout_s: float = 10.0) -> float | None:
    """Seconds from t0 until `proc` stopped running (a zombie waiting for init to reap it counts), or None."""
    while time.monotonic() - t0 < timeout_s:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - t0
        except psutil.NoSuchProcess:
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _kill_parent_then_time(actor: subprocess.Popen, child: psutil.Process) -> float | None:
    """kill -9 the stand-in actor; seconds until the child stopped (None: still running 10 s later).
    Both are killed afterwards, whatever happened."""
    try:
        t0 = time.monotonic()
        actor.send_signal(signal.SIGKILL)
        actor.wait()
        return _ended_after(child, t0)
    finally:
        for p in (actor, child):
            try:
                p.kill()
            except (OSError, psutil.Error):
                pass


def test_a_marked_child_is_asked_to_stop_when_its_parent_is_killed_9(tmp_path):
    actor, child, log = _start(True, tmp_path)
    took = _kill_parent_then_time(actor, child)
    # asked to stop (its SIGTERM handler ran), well before the SIGKILL that would follow 5 s later
    assert (took is not None and took < 4.0, open(log).read().split()) == (True, ["following", "sigterm"]), took


def test_without_pidfds_a_marked_child_notices_the_reparenting_and_stops(tmp_path):
    actor, child, log = _start(True, tmp_path, pidfd=False)
    took = _kill_parent_then_time(actor, child)
    # asked to stop at its next check (every 0.5 s here), not by the SIGKILL 5 s later
    assert (took is not None and took < 4.0, open(log).read().split()) == (True, ["following", "sigterm"]), took


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    actor, child, log = _start(True, tmp_path, grace_s=0.5)
    took = _kill_parent_then_time(actor, child)
    assert took is not None and 0.5 <= took < 4.0, took


def test_an_unmarked_child_is_left_alone(tmp_path):
    actor, child, log = _start(False, tmp_path)
    try:
        actor.kill()
        actor.wait()
        still_running = _ended_after(child, time.monotonic(), timeout_s=2.0) is None
    finally:
        child.kill()
    assert (still_running, open(log).read().split()) == (True, ["not", "following"])


def test_only_processes_below_the_actor_follow():
    assert parent_death.should_follow("1234", 5678)  # spawned below actor 1234
    assert not parent_death.should_follow("1234", 1234)  # the actor itself (vLLM loads plugins there too)
    assert not parent_death.should_follow(None, 1234)  # not started by a raypd engine: vLLM as shipped
    assert not parent_death.should_follow("", 1234)


def test_a_child_in_a_session_of_its_own_is_killed_at_once(tmp_path):
    """Out of the actor's process group the raylet's SIGKILL of that group misses it: it kills itself."""
    actor, child, log = _start(True, tmp_path, own_session=True)
    took = _kill_parent_then_time(actor, child)
    # no SIGTERM handler ran: killed, well before the 5 s grace a SIGTERM gets
    assert (took is not None and took < 2.0, open(log).read().split()) == (True, ["following"]), took
