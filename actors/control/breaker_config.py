"""The pair breakers' settings (a deployment's `breaker:` section), as plain config.

The coordinator's ledger (`actors.control.ledger`) keeps one breaker per (prefill, decode) pair
with them; the router reads `probe_window_s` to hold a half-open pair's probe well within it."""

from __future__ import annotations

from pydantic import Field

from actors.config_base import StrictModel


class BreakerConfig(StrictModel):
    """Per (prefill, decode) pair; the deployment file's `breaker:` section."""

    failure_threshold: int = Field(3, ge=1, description=(
        "failures in a row (transfers, handshakes, prefills) that open a (prefill, decode) pair's breaker"))
    cooldown_s: float = Field(10.0, gt=0, description="an open pair stays open this long, then one probe may try it")
    probe_window_s: float = Field(5.0, gt=0, description=(
        "a half-open pair's probe must report within this window (routers hold a won probe for half of it)"))
