"""Child processes a killed engine actor leaves behind, reaped by its next incarnation.

vLLM runs its engine core (and, with TP/PP > 1, its workers) as child
processes of the EngineActor. When the actor is killed (-9, OOM), vLLM does not
terminate them. Ray's raylet kills a dead worker's process group, and they
stop themselves when their parent dies (`actors.engine.vllm.parent_death`); this
is the last fallback, for a process that escaped both. Ray's own subreaper is off by
default, so raypd keeps a small record per engine on the node: after start, the engine's child pids (with their start times, so a
reused pid is never mistaken for one of ours); before the next start on that
node, the previous incarnation's recorded processes still alive are killed.
A restarted actor lands on the same node (its placement group bundle), so it
finds the record. A live engine's own shutdown reaps its children directly
(`reap_children`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger("raypd.orphans")


def record_path(engine_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"raypd-{engine_id}.children.json"


@dataclass(frozen=True)
class Child:
    """One recorded descendant: its pid and start time (a reused pid has another)."""

    pid: int
    create_time: float

    def process(self) -> psutil.Process | None:
        """The running process this record names; None once it ended (or its pid now names another)."""
        import psutil

        try:
            proc = psutil.Process(self.pid)
            return proc if abs(proc.create_time() - self.create_time) < 0.01 else None
        except psutil.Error:
            return None


def record_children(engine_id: str) -> tuple[Child, ...]:
    """Write down this process's descendants (vLLM's engine core and workers, started by now); returns them."""
    import psutil

    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            children.append(Child(child.pid, child.create_time()))
        except psutil.Error:
            continue
    path = record_path(engine_id)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"parent": os.getpid(), "children": [asdict(c) for c in children]}))
    os.replace(tmp, path)
    return tuple(children)


def live_pids(children: tuple[Child, ...]) -> list[int]:
    """The recorded children still running: O(children). Listing them again (psutil's `children()`)
    reads every process's /proc entry on the host, on the engine actor's event loop."""
    return [child.pid for child in children if child.process() is not None]


def reap_previous(engine_id: str, grace_s: float = 3.0) -> list[int]:
    """Kill the recorded children of an earlier incarnation that are still alive; their pids."""
    path = record_path(engine_id)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if record.get("parent") == os.getpid():
        return []  # our own record (start() called twice in one process)
    procs = []
    for entry in record.get("children", []):
        try:
            proc = Child(int(entry["pid"]), float(entry["create_time"])).process()
        except (KeyError, TypeError, ValueError):
            continue
        if proc is not None:
            procs.append(proc)
    _stop(procs, grace_s)
    path.unlink(missing_ok=True)
    if procs:
        logger.warning("%s: reaped %d process(es) of the previous incarnation: %s", engine_id, len(procs),
                       [p.pid for p in procs])
    return [p.pid for p in procs]


def forget(engine_id: str) -> None:
    """A clean shutdown reaped its own children: drop the record."""
    record_path(engine_id).unlink(missing_ok=True)


def reap_children(grace_s: float = 3.0) -> None:
    """vLLM's engine core and workers are our child processes: make sure none outlives the engine
    (a slow shutdown on a loaded machine must not strand them once the actor is killed)."""
    import psutil

    def is_vllm(proc: "psutil.Process") -> bool:
        try:
            return "resource_tracker" not in " ".join(proc.cmdline() or [])
        except psutil.Error:
            return False

    _stop([c for c in psutil.Process().children(recursive=True) if is_vllm(c)], grace_s)


def _stop(procs: list, grace_s: float) -> None:
    """SIGTERM, then SIGKILL what is still alive after `grace_s`."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
