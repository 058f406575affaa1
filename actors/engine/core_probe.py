"""An engine actor's answer to the coordinator's liveness probe (`EngineActor.ping`).

The actor answered, so its loop runs; what is left to check is the engine core behind it:
a backend with `probe()` (vLLM: a utility call, answered between steps) must answer within
CORE_PROBE_S. A core that does not, but whose steps kept reaching the actor meanwhile
(a backend's `steps()`), is busy, not stuck: the answer is still "pong". Only a core that
neither answered nor stepped is reported stuck, and the coordinator counts that as a failed
probe (`actors.control.liveness`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors.control.liveness import PONG

logger = logging.getLogger("raypd.engine")

CORE_PROBE_S = 8.0  # the engine core's answer to a liveness probe: under restarts.probe_timeout_s


async def core_answer(backend: Any, engine_id: str, probe_s: float = CORE_PROBE_S) -> str:
    """"pong", or what is stuck."""
    probe = getattr(backend, "probe", None)
    if probe is None:
        return PONG
    steps = getattr(backend, "steps", None)
    before = steps() if steps is not None else None
    try:
        await asyncio.wait_for(probe(), probe_s)
    except asyncio.TimeoutError:
        if before is not None and steps() != before:
            logger.warning("%s: the engine core took over %.0f s to answer a probe but stepped %d times "
                           "meanwhile: busy, not stuck", engine_id, probe_s, steps() - before)
            return PONG
        return f"the engine core did not answer in {probe_s:.0f} s"
    except Exception as exc:  # noqa: BLE001 - a dead core is found by the backend's dead_reason
        logger.info("%s: core probe failed: %s", engine_id, exc)
    return PONG
