"""EngineActor.shutdown bounds each step before vLLM's own: a relay or a coordinator call that never
ends is left behind after SHUTDOWN_STEP_S (logged), so the caller's ray.get returns."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

import actors.engine.actor as actor_module
from actors.engine.actor import EngineActor


def test_a_shutdown_step_that_never_ends_is_left_behind(monkeypatch, caplog):
    monkeypatch.setattr(actor_module, "SHUTDOWN_STEP_S", 0.05)
    fake = SimpleNamespace(engine_id="e0")
    cancelled = []

    async def never() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def go() -> float:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="raypd.engine"):
            await EngineActor._shutdown_step(fake, "the KV events relay", never())
        took = time.monotonic() - t0
        await asyncio.sleep(0)  # the left-behind step sees its cancellation
        return took

    took = asyncio.run(go())
    assert (took < 1.0, cancelled, "the KV events relay did not end within" in caplog.text) == (True, [True], True)


def test_a_shutdown_step_that_fails_raises_its_error(monkeypatch):
    async def broken() -> None:
        raise RuntimeError("relay broke")

    with pytest.raises(RuntimeError, match="relay broke"):
        asyncio.run(EngineActor._shutdown_step(SimpleNamespace(engine_id="e0"), "the relay", broken()))
