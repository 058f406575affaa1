"""Start-up phases of one engine, so `raypd up` can say what each engine is doing.

An engine records each phase as it reaches it (placed on node, loading weights,
KV cache registered, handshake published, ready; or failed); the launcher polls
`EngineActor.start_phases` while `start()` runs, and never once the engine is up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

PLACED, LOADING, KV_REGISTERED, HANDSHAKE_PUBLISHED, READY, FAILED = (
    "placed on node", "loading weights", "KV cache registered", "handshake published", "ready", "failed")
# Concurrency group of `start_phases`: answered while a backend's start blocks the default loop
# (vLLM builds its engine synchronously).
STARTUP_GROUP = "startup"


@dataclass(frozen=True)
class StartPhase:
    engine_id: str
    phase: str
    at: float  # wall clock (time.time()) when reached
    detail: str = ""


class StartupLog:
    """Phases reached so far (written by the engine's loop, read from the startup group's thread)."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._phases: list[StartPhase] = []
        self._lock = threading.Lock()

    def reached(self, phase: str, detail: str = "") -> None:
        with self._lock:
            self._phases.append(StartPhase(self.engine_id, phase, time.time(), detail))

    def failed(self, exc: BaseException) -> None:
        self.reached(FAILED, f"{type(exc).__name__}: {exc}"[:500])

    def start_s(self) -> float:
        """Seconds from the first phase (placed: the actor's creation) to the handshakes' publication
        (its registration), or to now before that; 0 with no phase."""
        with self._lock:
            if not self._phases:
                return 0.0
            end = next((p.at for p in self._phases if p.phase == HANDSHAKE_PUBLISHED), time.time())
            return end - self._phases[0].at

    def phases(self) -> list[StartPhase]:
        with self._lock:
            return list(self._phases)
