"""What an engine reports of itself (`EngineActor.stats()`): its load, its backend, its KV event relay.

Typed and picklable over Ray; `raypd status` and the metrics read them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.rates import EngineRates


@dataclass(frozen=True)
class LoadSnapshot:
    """An engine's queues (now and time-weighted) and recent latencies (`actors.engine.load`)."""

    queued_prompt_tokens: int
    queued_prompt_tokens_avg: float
    outstanding_tokens: int
    outstanding_tokens_avg: float
    prefill_latency_p90_s: float | None
    itl_p90_s: float | None
    # what the engine measured of itself (its rate model, `rates`; None before any sample), for scaling
    prefill_tokens_per_s: float | None = None  # prompt tokens per second its prefills computed
    step_s: float | None = None  # one decode step at its recent batch
    arrivals_per_s: float = 0.0  # decode requests started per second, recently
    prompt_tokens_avg: float | None = None  # of the requests it decoded
    output_tokens_avg: float | None = None
    rates: EngineRates | None = None  # its one rate model and queues, as it publishes them (`actors.rates`)


@dataclass(frozen=True)
class KVEventsStats:
    """An engine's KV cache event relay to the prefix index (vLLM backend)."""

    endpoint: str
    block_size: int
    algo: str
    batches: int = 0
    events: int = 0
    gaps: int = 0
    delivery_failures: int = 0
    dropped: int = 0  # events dropped because the sink fell too far behind
    skipped: int = 0  # stored blocks a router cannot key (LoRA, extra keys, other media)
    hash_checks: int = 0
    hash_mismatch: str | None = None


@dataclass(frozen=True)
class BackendStats:
    """What a backend knows of itself: its KV blocks and leases, what it moved, its processes."""

    backend: str  # vllm | synthetic
    num_blocks: int = 0
    free_blocks: int = 0
    held_leases: int = 0  # prefills whose blocks wait for their reader
    transfer_bytes: int = 0
    handshakes: int = 0
    child_pids: tuple[int, ...] = ()
    # the backend's own counters (vLLM: kv_pulls, kv_failures, recomputed, released, engine_running...;
    # synthetic: decoding, rank_incarnation), shown as they are by `raypd status`
    counters: dict[str, int | str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """`EngineActor.stats()`: the actor's request counters, its backend's stats, its load."""

    engine_id: str
    role: str
    pid: int
    generation: int | None  # the coordinator's registration of this incarnation
    restarted: bool  # this process is a restart by Ray
    running: int  # requests in the actor now
    requests: int
    finished: int
    errors: int
    aborted: int
    recomputed: int
    backend: BackendStats
    load: LoadSnapshot
    kv_events: KVEventsStats | None = None
    inbox_streams: int = 0  # streams whose chunks went to a same-node inbox, not as Ray items

    @property
    def num_blocks(self) -> int:
        return self.backend.num_blocks

    @property
    def free_blocks(self) -> int:
        return self.backend.free_blocks

    @property
    def held_leases(self) -> int:
        return self.backend.held_leases
