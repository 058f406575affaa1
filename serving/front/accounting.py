"""Admission and request accounting: one place where in-flight counts and metrics settle.

Life cycle of a generation request here:

  arrival    `Accounting.start(kind)` -> `RequestTicket` (clock starts);
  admission  `ticket.admit()` takes an in-flight slot or raises 429;
  tokens     `ticket.observe(chunk)` records TTFT / ITL and the finish;
  end        `ticket.settle(status)` exactly once, whatever path ended it
             (JSON answer, end of the SSE stream, client gone, error): frees
             the slot, counts the request by status, records latency and tokens.
"""

from __future__ import annotations

import time
from typing import Any

from actors.protocol.request import TokenChunk
from serving.front.http_errors import ApiError
from serving.ops.metrics import ServiceMetrics
from serving.routing.protocols import TokenStream


class Accounting:
    def __init__(self, metrics: ServiceMetrics, max_inflight: int):
        self.metrics, self.max_inflight = metrics, max_inflight
        self.inflight = 0

    def start(self, kind: str) -> "RequestTicket":
        return RequestTicket(self, kind)


class RequestTicket:
    def __init__(self, accounting: Accounting, kind: str):
        self.accounting, self.kind = accounting, kind
        self.metrics = accounting.metrics
        self.t0 = time.perf_counter()
        self.admitted = False
        self.settled = False
        self.last_token_at: float | None = None
        self.num_token_chunks = 0
        self.path = "unknown"  # the P/D path the router took: pd | local | fallback
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stream: TokenStream | None = None  # once routed: closed on settle

    def admit(self) -> None:
        acc = self.accounting
        if acc.inflight >= acc.max_inflight:
            raise ApiError(429, f"too many requests in flight ({acc.max_inflight}); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        acc.inflight += 1
        self.admitted = True

    def observe(self, chunk: TokenChunk) -> None:
        if chunk.token_ids or chunk.text:
            now = time.perf_counter()
            m = self.metrics
            if self.last_token_at is None:
                self.path = self.stream.route.path if self.stream is not None else self.path
                m.ttft(self.kind, self.path, now - self.t0)
            else:
                m.itl(self.kind, self.path, now - self.last_token_at)
                if self.num_token_chunks == 1 and self.path == "pd":
                    m.handoff(self.kind, now - self.last_token_at)  # prefill's token -> decode's first
            self.num_token_chunks += 1
            self.last_token_at = now
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"
            if chunk.failed:
                self.error = chunk.error or "the engine failed the request"

    @property
    def completed(self) -> bool:
        return self.finish_reason is not None and self.error is None

    def usage(self, details: bool = True) -> dict[str, Any]:
        """The answer's usage so far; `details` False: without the prompt's cached tokens (vLLM's
        per-chunk usage of `continuous_usage_stats` has none)."""
        p = self.stream.num_prompt_tokens if self.stream is not None else 0
        c = self.stream.num_generated if self.stream is not None else 0
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        cached = self.stream.num_cached_tokens if self.stream is not None else None
        if details and cached is not None:  # as OpenAI / vLLM (--enable-prompt-tokens-details) report it
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def settle(self, status: str | None = None) -> None:
        """Once: close the stream (aborting it if unfinished), free the slot, count.
        `status` None: 200 when the answer completed, else stream_error or 499 (client gone)."""
        if self.settled:
            return
        self.settled = True
        if status is None:
            status = "200" if self.completed else ("stream_error" if self.error else "499")
        m = self.metrics
        if self.stream is not None:
            self.stream.close()
            m.tokens(self.stream.num_prompt_tokens if status == "200" else 0, self.stream.num_generated)
        if self.admitted:
            self.accounting.inflight -= 1
        m.request(self.kind, status)
        if status == "200":
            m.e2e(self.kind, time.perf_counter() - self.t0)
