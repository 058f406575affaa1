"""Processes on this host: trees, CPU time, per-thread affinity, host load.

Everything reads /proc; nothing here starts or stops a process. CPU figures are
`utime + stime` ticks of /proc/<pid>/stat, in % of one core over a wall-clock
window, so a process that spins one thread shows ~100.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                kids += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return kids


def tree(*roots: int) -> list[int]:
    """`roots` and all their descendants that are alive now (parents first)."""
    out: list[int] = []
    todo = list(roots)
    while todo:
        p = todo.pop(0)
        if p in out or not alive(p):
            continue
        out.append(p)
        todo += children_of(p)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cpu_ticks(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def host_busy_ticks() -> int:
    """All CPUs' non-idle ticks since boot (/proc/stat `cpu` line, minus idle and iowait)."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(parts) - parts[3] - parts[4]


def ppid(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_name(pid: int) -> str:
    """A short, stable name: the Ray/vLLM process title, or what the command runs."""
    cmd = cmdline(pid)
    if cmd.startswith(("ray::", "VLLM::")):
        return cmd.split(" ")[0][:48]
    for marker, name in (("multiprocessing.resource_tracker", "resource_tracker"),
                         ("vllm.entrypoints.openai.api_server", "vllm api_server"),
                         ("pdbench/proxy.py", "bench proxy"), ("raypd up", "raypd up"),
                         ("serve_llm_app.py", "serve_llm driver"), ("idle_actors.py", "idle-actor driver"),
                         ("gcs_server", "gcs_server"), ("raylet", "raylet"),
                         ("dashboard", "ray dashboard"), ("log_monitor", "ray log_monitor"),
                         ("runtime_env", "ray runtime_env agent")):
        if marker in cmd:
            return name
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def thread_affinities(pid: int) -> list[str]:
    """Distinct Cpus_allowed_list values of the process's threads, main thread first."""
    seen: list[str] = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda t: (t != str(pid), int(t)))
    except OSError:
        return seen
    for t in tids:
        try:
            for line in Path(f"/proc/{pid}/task/{t}/status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    v = line.split(":", 1)[1].strip()
                    if v not in seen:
                        seen.append(v)
        except OSError:
            pass
    return seen


# vLLM's engine core logs its binding: "(EngineCore pid=N) ... VLLM_CPU_OMP_THREADS_BIND='0', ...".
_BIND_LOG = re.compile(r"pid=(\d+)\).*VLLM_CPU_OMP_THREADS_BIND='([^']*)'")


def binds_from_logs(paths: list[Path]) -> dict[int, str]:
    """Engine-core pid -> its VLLM_CPU_OMP_THREADS_BIND, as vLLM logged it.

    Needed because vLLM and Ray retitle their processes (setproctitle), which
    wipes /proc/<pid>/environ: the workers' own environment is unreadable.
    """
    out: dict[int, str] = {}
    for path in paths:
        try:
            with open(path, "rb") as fh:
                lines = [ln for ln in fh if b"VLLM_CPU_OMP_THREADS_BIND=" in ln]
        except OSError:
            continue
        for ln in lines:
            if m := _BIND_LOG.search(ln.decode(errors="replace")):
                out[int(m.group(1))] = m.group(2)
    return out


def resolve_binds(pids: list[int], logged: dict[int, str]) -> dict[int, str]:
    """Each process's engine core bind: its own env or log entry, else its nearest ancestor's,
    else (for the process that owns an engine, e.g. a Ray actor) the one bind below it."""
    own = {p: environ(p).get("VLLM_CPU_OMP_THREADS_BIND") or logged.get(p) for p in pids}
    parent = {p: ppid(p) for p in pids}
    out: dict[int, str] = {}
    for p in pids:
        q = p
        while q in own and not own[q]:
            q = parent[q]
        if q in own and own[q]:
            out[p] = own[q]
    for p in pids:
        if p not in out:
            below = {out[c] for c in tree(p) if c in out}
            if len(below) == 1:
                out[p] = below.pop()
    return out


@dataclass
class Pinning:
    pid: int
    name: str
    core: int
    before: list[str]
    after: list[str]


def pin_engine_workers(pids: list[int], binds: dict[int, str]) -> list[Pinning]:
    """Confine every thread of each vLLM worker process to the core its engine was given.

    The core is the engine's own `VLLM_CPU_OMP_THREADS_BIND` (one core per
    engine in every set-up). vLLM's NixlConnector moves the worker's main thread
    to the host's last core at start-up (`os.sched_setaffinity(0, [last core])`
    in nixl/base_worker.py), so on 2 cores both engines would compute on core 1;
    this undoes that, for every set-up alike (a no-op where nothing moved).
    Threads created later inherit the pinned affinity of their creator.
    """
    done = []
    for pid in pids:
        name = proc_name(pid)
        bind = binds.get(pid, "")
        if not name.startswith("VLLM::Worker") or not bind.isdigit():
            continue
        core = int(bind)
        before = thread_affinities(pid)
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, {core})
            except OSError:
                pass  # the thread ended meanwhile
        done.append(Pinning(pid, name, core, before, thread_affinities(pid)))
    return done


def all_ticks() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            t = cpu_ticks(int(d))
            if t is not None:
                out[int(d)] = t
    return out


class CpuWindow:
    """CPU used by given processes, and by everything else on the host, over one window.

    Processes that start during the window and are listed at `close()` count
    in full. "Others" = the host's busy time minus ours; the top foreign
    consumers are named (by their start-of-window tick counts).
    """

    def __init__(self, pids: list[int]):
        self.t0 = time.monotonic()
        self.busy0 = host_busy_ticks()
        self.ticks0 = all_ticks()
        self.pids = list(pids)

    def close(self, more_pids: list[int] = ()) -> dict:
        wall = time.monotonic() - self.t0
        busy = host_busy_ticks() - self.busy0
        now = all_ticks()
        mine = set(self.pids) | set(more_pids)
        per: dict[int, float] = {}
        ours = 0
        for p in mine:
            if p in now:
                d = now[p] - self.ticks0.get(p, 0)
                per[p] = 100.0 * d / CLK_TCK / wall
                ours += d
        foreign = sorted(((now[p] - a, p) for p, a in self.ticks0.items() if p in now and p not in mine),
                         reverse=True)[:3]
        top = [f"{100.0 * d / CLK_TCK / wall:.0f}% pid {p} {(cmdline(p) or proc_name(p))[:70]}"
               for d, p in foreign if d > 0]
        return {"wall_s": wall, "per_pid_pct": per, "ours_pct": 100.0 * ours / CLK_TCK / wall,
                "host_pct": 100.0 * busy / CLK_TCK / wall,
                "others_pct": max(0.0, 100.0 * (busy - ours) / CLK_TCK / wall), "others_top": top}


def host_state() -> dict:
    la = os.getloadavg()
    return {"loadavg": [round(x, 2) for x in la], "cpus": NCPU, "time": time.time()}


def cpu_seconds_by_kind(pids: list[int], per_pid_pct: dict[int, float], wall_s: float) -> dict:
    """A set-up's CPU over a window, in seconds: `compute` (vLLM's engine cores and workers, and
    what runs under them), `front` (each process that owns a vLLM engine core: vLLM's API server,
    raypd's EngineActor, a Serve LLM engine replica; and its other children), `rest` (everything
    else the set-up started: Ray's and Serve's processes, raypd's ingress and coordinator, proxies);
    plus the seconds of every process by name."""
    parent = {p: ppid(p) for p in pids}
    names = {p: proc_name(p) for p in pids}
    kids: dict[int, list[int]] = {}
    for p, q in parent.items():
        kids.setdefault(q, []).append(p)
    compute: set[int] = set()
    for p in pids:
        if names[p].startswith("VLLM::"):
            compute |= set(tree(p)) & set(pids) | {p}
    front: set[int] = set()
    for p in pids:
        if p not in compute and any(names.get(k, "").startswith("VLLM::EngineCore") for k in kids.get(p, [])):
            front |= {p} | {k for k in kids.get(p, []) if k not in compute}
    out = {"compute": 0.0, "front": 0.0, "rest": 0.0, "by_process": {}}
    for p in pids:
        sec = per_pid_pct.get(p, 0.0) * wall_s / 100.0
        kind = "compute" if p in compute else "front" if p in front else "rest"
        out[kind] += sec
        label = f"{kind}: {names[p]}"
        out["by_process"][label] = out["by_process"].get(label, 0.0) + sec
    out["by_process"] = {k: round(v, 3) for k, v in sorted(out["by_process"].items(), key=lambda kv: -kv[1])}
    for k in ("compute", "front", "rest"):
        out[k] = round(out[k], 3)
    return out
