"""Per-request hop stamps on the way to the first token, shown to the client that asks.

With `http.trace` on, a request sent with `X-Raypd-Trace: 1` gets an `X-Raypd-Trace`
response header: `hop=seconds;...` in the order they were taken, each a
CLOCK_MONOTONIC reading (`actors.protocol.Stamps`): the front's (handler entry,
prepared), the router's (routed, first token back), the engine's (actor entry,
vLLM's queue / compute / output, actor exit) and the moment the front writes the
response (`sse`). Every process of one host shares that clock, so a client on
the same host can put its own `time.monotonic()` readings beside them; across
hosts, compare only stamps taken in one process. The stamps are taken for every
request (a clock read each); only the header is optional.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.protocol.request import Stamps

HEADER = "x-raypd-trace"


def requested(headers: object, enabled: bool) -> bool:
    return enabled and getattr(headers, "get")(HEADER) == "1"


def header_value(stamps: Iterable[tuple[str, float]]) -> str:
    return ";".join(f"{name}={value:.6f}" for name, value in stamps)


def parse(value: str) -> list[tuple[str, float]]:
    """The header's stamps (the benchmark's reader)."""
    out = []
    for part in value.split(";"):
        name, _, v = part.partition("=")
        if name and v:
            out.append((name, float(v)))
    return out


class RequestTrace:
    """One request's stamps as the front collects them (front -> router/engines -> front)."""

    __slots__ = ("stamps",)

    def __init__(self) -> None:
        self.stamps: list[tuple[str, float]] = [Stamps.now(Stamps.FRONT_IN)]

    def mark(self, name: str) -> None:
        self.stamps.append(Stamps.now(name))

    def extend(self, stamps: Iterable[tuple[str, float]]) -> None:
        self.stamps.extend(stamps)

    def header(self) -> tuple[bytes, bytes]:
        return HEADER.encode(), header_value(self.stamps).encode()

    def header_str(self) -> tuple[str, str]:
        return HEADER, header_value(self.stamps)
