"""What an engine tells the coordinator when it registers, and how the coordinator lists it.

A decode engine's ledger traffic travels as the records of `actors.control.ledger_records`;
routers read the coordinator's `RouteTable` (`actors.routes`), not these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself when it registers (beside its handshake payloads)."""

    backend: str = "synthetic"
    model: str = ""
    pid: int = 0
    node_id: str = ""  # the Ray node its process runs on (a hung one is killed there too: `liveness`)
    start_s: float = 0.0  # its actor's creation to its first registration (the start-up deadline follows it)
    actor_id: str = ""  # the registering actor's Ray id (hex): the coordinator fences it once Ray declares it dead


@dataclass(frozen=True)
class EngineStart:
    """`EngineActor.start()`: the engine is up (registered, when a coordinator is configured)."""

    engine_id: str
    role: str
    pairs: dict[str, str] = field(default_factory=dict)  # "prefill->decode" -> "ok" or why it is refused
    restarted: bool = False  # this process is a restart by Ray


@dataclass(frozen=True)
class EngineSummary:
    """One registered engine incarnation as `Coordinator.engines()` lists it."""

    engine_id: str
    role: str
    model_id: str
    compat_hash: str
    tp_size: int
    pp_size: int
    dcp_size: int
    block_size: int
    ranks: int
    generation: int
    draining: bool
    info: EngineInfo = EngineInfo()
