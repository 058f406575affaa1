"""Which processes a fault of benchmarks/faults.py signals, per set-up, and the wait for recovery.

An engine is found the way the CPU pinning finds it (pdbench/procs.py): the `VLLM::EngineCore`
process whose `VLLM_CPU_OMP_THREADS_BIND` (from vLLM's own log line) is the engine's core.
  raypd (b), (e)  the engine core's parent is its Ray actor (`ray::...`): the tree of that actor
                  (actor + engine core) is signalled; Ray/raypd restart a killed one.
                  (b): prefill = core 0, decode = core 1; (e): both engines are role `both`,
                  "decode" = the engine of core 1, "prefill" = the engine of core 0.
  (c)             the tree of the decode (or prefill) vLLM OpenAI server; nothing restarts it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import httpx

from pdbench import procs, setups

CORE = {"prefill": "0", "decode": "1"}


def engine_cores(group: setups.Group) -> dict[str, int]:
    """core bind -> the alive engine-core pid of that core."""
    pids = group.all_pids()
    cores = [p for p in pids if procs.proc_name(p).startswith("VLLM::EngineCore")]
    binds = group.binds(pids)
    return {binds[p]: p for p in cores if p in binds}


def target(group: setups.Group, role: str) -> list[int]:
    """The process tree a fault on `role` ("prefill" / "decode") signals, parents first."""
    if isinstance(group, setups.VllmNixlPD):
        return procs.tree(group.procs[0 if role == "prefill" else 1].pid)
    core = engine_cores(group).get(CORE[role])
    if core is None:
        raise setups.SetupError(f"{group.key}: no engine core bound to core {CORE[role]}")
    parent = procs.ppid(core)
    root = parent if parent and procs.proc_name(parent).startswith("ray::") else core
    return procs.tree(root)


def send(pids: list[int], sig: signal.Signals) -> list[int]:
    """Signal every pid; returns those signalled."""
    done = []
    for p in pids:
        try:
            os.kill(p, sig)
            done.append(p)
        except ProcessLookupError:
            pass
    return done


class Injector(threading.Thread):
    """`begin()` at t0 + at_s (monotonic); `end()` `hold_s` later when given (SIGSTOP -> SIGCONT,
    partition -> heal). `begin` returns what it hit (the pids signalled, the hosts cut)."""

    def __init__(self, begin: Callable[[], list], end: Callable[[], object] | None, t0: float, at_s: float,
                 hold_s: float):
        super().__init__(daemon=True)
        self.begin, self.end, self.t0, self.at_s, self.hold_s = begin, end, t0, at_s, hold_s
        self.fault_s: float | None = None
        self.until_s: float | None = None
        self.hit: list = []

    @classmethod
    def signals(cls, pids: list[int], action: str, t0: float, at_s: float, stop_s: float) -> "Injector":
        """SIGKILL the tree (action "kill"), or SIGSTOP it and SIGCONT after `stop_s` ("stop")."""
        if action == "kill":
            return cls(lambda: send(pids, signal.SIGKILL), None, t0, at_s, 0.0)
        return cls(lambda: send(pids, signal.SIGSTOP), lambda: send(pids, signal.SIGCONT), t0, at_s, stop_s)

    def run(self) -> None:
        time.sleep(max(0.0, self.t0 + self.at_s - time.monotonic()))
        self.fault_s = round(time.monotonic() - self.t0, 2)
        self.hit = self.begin()
        if self.end is not None:
            time.sleep(self.hold_s)
            self.end()
            self.until_s = round(time.monotonic() - self.t0, 2)


def wait_raypd_recovered(group: setups.RaypdUp, engines: int, gone: set[int], timeout_s: float) -> float | None:
    """Seconds until `engines` engine cores run again, none of them in `gone`, and the front's
    /health answers 200; None if not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        cores = engine_cores(group)
        if len(cores) >= engines and not set(cores.values()) & gone:
            try:
                if httpx.get(group.url + "/health", headers=group.headers, timeout=5).status_code == 200:
                    return round(time.monotonic() - t0, 1)
            except httpx.HTTPError:
                pass
        time.sleep(1.0)
    return None


AT_REST = ("raypd_engine_running_requests", "raypd_leases_held", "raypd_engine_free_blocks",
           "raypd_engine_num_blocks", "raypd_engine_up", "raypd_prefill_queue_depth", "raypd_decode_queue_depth")


def settled(rest: dict) -> bool:
    """Nothing held: no lease, no running request, every block free."""
    return (rest.get("leases_held") == 0 and rest.get("engine_running_requests") == 0
            and rest.get("engine_free_blocks") == rest.get("engine_num_blocks"))


def wait_at_rest(group: setups.Group, timeout_s: float) -> tuple[dict, float | None]:
    """raypd's /metrics polled until nothing is held (a lease whose holder was cut off ends at its TTL);
    what it shows then (or at the timeout) and the seconds it took (None: still held)."""
    t0 = time.monotonic()
    while True:
        rest = at_rest(group)
        if settled(rest):
            return rest, round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 > timeout_s:
            return rest, None
        time.sleep(2.0)


def at_rest(group: setups.Group) -> dict:
    """raypd: what its /metrics shows left at rest (summed over engines); others: n/a."""
    if not isinstance(group, setups.RaypdUp):
        return {"n/a": "the set-up exposes no lease or block counts"}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(group.url + "/metrics", headers=group.headers, timeout=15).text
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in AT_REST:
            out[fam.name.removeprefix("raypd_")] = sum(s.value for s in fam.samples)
    return out
