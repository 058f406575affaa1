"""The coordinator: one named Ray actor per cluster that engines register with.

Life cycle of an engine as the coordinator sees it:

  register_engine   every rank's handshake payload is decoded and checked
                    (protocol, compat hash, sizes); the engine is refused if its
                    model id is known under another compatibility hash; every
                    (prefill, decode) pair it forms is judged once and the
                    verdict (ok or the reason) is kept for the router;
  handshake_payloads  decode ranks fetch exactly the payloads of the remote
                    ranks they need, per pp rank (no side-channel ports);
  heartbeat / ping  the monitor pings each engine's liveness handles and
                    counts missed heartbeats; a dead engine is unregistered
                    and every decode rank is told to drop its agents, so a
                    restarted engine is always met with a fresh handshake.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.kv.aggregator import KVConnectorOutput
from actors.kv.compat import pair_problem
from actors.kv.errors import HandshakeError
from actors.kv.handshake import RankHandshake, decode_handshake
from actors.ledger import BreakerSettings, TransferLedger, Verdict

logger = logging.getLogger("raypd.coordinator")

COORDINATOR_NAME = "raypd-coordinator"
NAMESPACE = "raypd"
ROLES = ("prefill", "decode", "both")


class RegistrationError(ValueError):
    """An engine's registration was refused; the message says why."""


@dataclass
class EngineEntry:
    engine_id: str
    role: str
    ranks: dict[tuple[int, int], RankHandshake]  # (pp rank, tp rank) -> handshake
    raw: dict[tuple[int, int], bytes]
    handles: list[Any]  # actor handles whose death means the engine is dead
    info: dict[str, Any]
    registered_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    generation: int = 0

    @property
    def head(self) -> RankHandshake:
        return self.ranks[min(self.ranks)]

    def summary(self) -> dict[str, Any]:
        h = self.head
        return {
            "engine_id": self.engine_id, "role": self.role, "model_id": h.compat.model_id,
            "compat_hash": h.compat.compat_hash(), "tp_size": h.tp_size, "pp_size": h.pp_size,
            "dcp_size": h.dcp_size, "block_size": h.block_size, "ranks": len(self.ranks),
            "generation": self.generation, **self.info,
        }


class Coordinator:
    def __init__(self, heartbeat_timeout_s: float = 15.0, check_interval_s: float = 1.0,
                 ping_timeout_s: float = 5.0, handoff_deadline_s: float = 60.0,
                 breaker: dict | None = None):
        self.ledger = TransferLedger(deadline_s=handoff_deadline_s,
                                     breaker_settings=BreakerSettings(**(breaker or {})))
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.check_interval_s = check_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._engines: dict[str, EngineEntry] = {}
        self._model_hash: dict[str, str] = {}
        self._pairs: dict[tuple[str, str], str | None] = {}  # (prefill, decode) -> problem
        self._generation = 0
        self._monitor: asyncio.Task | None = None
        self.events: list[dict[str, Any]] = []

    # ---------------------------------------------------------- registration
    async def register_engine(self, engine_id: str, role: str, handshakes: list[bytes],
                              handles: list[Any] | None = None, info: dict | None = None) -> dict:
        """Register (or re-register) an engine; returns the pair verdicts it formed."""
        self._ensure_monitor()
        if role not in ROLES:
            raise RegistrationError(f"role must be one of {ROLES}, got {role!r}")
        if not handshakes:
            raise RegistrationError(f"engine {engine_id!r} registered without handshake payloads")
        ranks: dict[tuple[int, int], RankHandshake] = {}
        raw: dict[tuple[int, int], bytes] = {}
        for data in handshakes:
            try:
                hs = decode_handshake(data)
            except HandshakeError as exc:
                raise RegistrationError(f"engine {engine_id!r}: {exc}") from None
            if hs.engine_id != engine_id or hs.role != role:
                raise RegistrationError(
                    f"engine {engine_id!r} ({role}) sent the payload of {hs.engine_id!r} ({hs.role})"
                )
            ranks[(hs.pp_rank, hs.tp_rank)] = hs
            raw[(hs.pp_rank, hs.tp_rank)] = data
        head = ranks[min(ranks)]
        expected = {(p, t) for p in range(head.pp_size) for t in range(head.tp_size)}
        if set(ranks) != expected:
            raise RegistrationError(
                f"engine {engine_id!r} must send tp x pp = {len(expected)} rank payloads, got {sorted(ranks)}"
            )
        if len({hs.compat.compat_hash() for hs in ranks.values()}) != 1:
            raise RegistrationError(f"engine {engine_id!r}: ranks disagree on the compatibility hash")
        model, chash = head.compat.model_id, head.compat.compat_hash()
        known = self._model_hash.get(model)
        if known is not None and known != chash and any(
            e.head.compat.model_id == model for e in self._engines.values() if e.engine_id != engine_id
        ):
            raise RegistrationError(
                f"engine {engine_id!r}: model {model!r} is already served with compatibility hash "
                f"{known}, this engine has {chash} (different dtype, layout or shapes)"
            )
        if engine_id in self._engines:
            await self._remove(engine_id, "re-registered")
        self._generation += 1
        entry = EngineEntry(engine_id, role, ranks, raw, list(handles or []), dict(info or {}),
                            generation=self._generation)
        self._engines[engine_id] = entry
        self._model_hash[model] = chash
        verdicts = {}
        for other in self._engines.values():
            if other.engine_id == engine_id:
                continue
            for p, d in ((entry, other), (other, entry)):
                if p.role in ("prefill", "both") and d.role in ("decode", "both"):
                    problem = pair_problem(list(p.ranks.values()), list(d.ranks.values()))
                    self._pairs[(p.engine_id, d.engine_id)] = problem
                    verdicts[f"{p.engine_id}->{d.engine_id}"] = problem or "ok"
                    if problem:
                        logger.warning("pair %s -> %s refused: %s", p.engine_id, d.engine_id, problem)
        self._event("registered", engine_id, role=role, generation=entry.generation)
        return verdicts

    async def unregister_engine(self, engine_id: str, reason: str = "unregistered") -> bool:
        if engine_id not in self._engines:
            return False
        await self._remove(engine_id, reason)
        return True

    async def _remove(self, engine_id: str, reason: str) -> None:
        entry = self._engines.pop(engine_id)
        self._pairs = {k: v for k, v in self._pairs.items() if engine_id not in k}
        for handoff in self.ledger.forget_engine(engine_id):
            self._release_prefill(handoff.prefill_id, handoff.req_id)
        self._event("removed", engine_id, reason=reason)
        # Tell every decode rank to drop the agents of this engine (fire and forget:
        # a rank that is itself dead will not answer, and that is fine).
        for other in self._engines.values():
            if other.role in ("decode", "both"):
                for handle in other.handles:
                    try:
                        handle.drop_engine.remote(engine_id)
                    except Exception as exc:  # noqa: BLE001 - a dead handle is not our failure
                        logger.info("telling a rank of %s to drop %s: %s", other.engine_id, engine_id, exc)
        del entry

    # --------------------------------------------------------------- queries
    async def handshake_payloads(self, engine_id: str, pp_rank: int, tp_ranks: list[int]) -> list[bytes]:
        """The payloads of exactly these ranks of one pp stage of an engine."""
        entry = self._engines.get(engine_id)
        if entry is None:
            raise RegistrationError(f"engine {engine_id!r} is not registered")
        try:
            return [entry.raw[(pp_rank, r)] for r in tp_ranks]
        except KeyError as exc:
            raise RegistrationError(f"engine {engine_id!r} has no rank {exc.args[0]}") from None

    async def pair_verdict(self, prefill_id: str, decode_id: str) -> str | None:
        """None when the pair may be routed, else the reason it may not."""
        if prefill_id not in self._engines or decode_id not in self._engines:
            return "engine not registered"
        return self._pairs.get((prefill_id, decode_id), "pair never judged")

    async def compatible_prefills(self, decode_id: str) -> list[str]:
        """Prefill engines the router may pair with `decode_id`: compatible, breaker not open."""
        return sorted(p for (p, d), problem in self._pairs.items()
                      if d == decode_id and problem is None and not self.ledger.is_open(decode_id, p))

    # ---------------------------------------------------------------- ledger
    async def open_handoff(self, req_id: str, prefill_id: str, decode_id: str) -> None:
        self.ledger.open(req_id, prefill_id, decode_id)

    async def report_outcomes(self, decode_id: str, outputs: list[KVConnectorOutput | None]) -> list[dict]:
        """Per-unit transfer outcomes of a decode engine -> verdicts (feeds the breakers)."""
        verdicts = self.ledger.report(decode_id, outputs)
        for v in verdicts:
            if not v.ok:
                self._event("transfer_failed", decode_id, req_id=v.req_id, prefill_id=v.prefill_id)
        return [self._verdict_dict(v) for v in verdicts]

    async def unit_died(self, decode_id: str, last_outputs: list[KVConnectorOutput | None]) -> None:
        self.ledger.rank_died(decode_id, last_outputs)

    async def handshake_failed(self, decode_id: str, prefill_id: str) -> None:
        self.ledger.record_handshake_failure(decode_id, prefill_id)

    async def transfers(self) -> dict:
        """In-flight handoffs, verdict counts and breaker states (for status/metrics)."""
        return self.ledger.snapshot()

    @staticmethod
    def _verdict_dict(v: Verdict) -> dict:
        return {"req_id": v.req_id, "prefill_id": v.prefill_id, "decode_id": v.decode_id, "ok": v.ok,
                "reason": v.reason}

    def _release_prefill(self, prefill_id: str | None, req_id: str) -> None:
        """Ask a prefill engine to let go of a request's blocks (best effort)."""
        entry = self._engines.get(prefill_id) if prefill_id else None
        if entry is not None and entry.handles:
            try:
                entry.handles[0].abort.remote(req_id)
            except Exception as exc:  # noqa: BLE001 - its lease expires anyway
                logger.info("releasing %s on %s: %s", req_id, prefill_id, exc)

    async def engines(self) -> list[dict]:
        return [e.summary() for e in self._engines.values()]

    async def heartbeat(self, engine_id: str) -> bool:
        entry = self._engines.get(engine_id)
        if entry is None:
            return False  # tells the engine to re-register (e.g. after a coordinator restart)
        entry.last_heartbeat = time.monotonic()
        return True

    async def recent_events(self, limit: int = 100) -> list[dict]:
        return self.events[-limit:]

    async def ping(self) -> str:
        return "pong"

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    # --------------------------------------------------------------- health
    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.check_engines()
                for v in self.ledger.expire():
                    self._event("handoff_expired", v.decode_id, req_id=v.req_id, prefill_id=v.prefill_id)
                    self._release_prefill(v.prefill_id, v.req_id)
            except Exception:  # noqa: BLE001 - the monitor must survive anything
                logger.exception("engine health check failed")

    async def check_engines(self) -> list[str]:
        """Ping every engine's handles; unregister the dead ones. Returns their ids."""
        dead = []
        now = time.monotonic()
        for entry in list(self._engines.values()):
            reason = None
            if entry.handles:
                try:
                    await asyncio.wait_for(
                        asyncio.gather(*(h.ping.remote() for h in entry.handles)), self.ping_timeout_s
                    )
                    entry.last_heartbeat = now
                except asyncio.TimeoutError:
                    reason = f"no ping answer in {self.ping_timeout_s}s"
                except ray.exceptions.RayError as exc:
                    reason = f"actor died: {type(exc).__name__}"
            if reason is None and now - entry.last_heartbeat > self.heartbeat_timeout_s:
                reason = f"no heartbeat for {now - entry.last_heartbeat:.1f}s"
            if reason is not None and entry.engine_id in self._engines:
                logger.warning("engine %s is dead: %s", entry.engine_id, reason)
                await self._remove(entry.engine_id, reason)
                dead.append(entry.engine_id)
        return dead

    def _event(self, kind: str, engine_id: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, "engine_id": engine_id, **fields})
        del self.events[:-1000]


def start_coordinator(detached: bool = False, on_head_node: bool = False, name: str = COORDINATOR_NAME,
                      **kwargs: Any) -> Any:
    """Get or create the cluster's coordinator actor (on the head node if asked)."""
    options: dict[str, Any] = dict(
        name=name, namespace=NAMESPACE, num_cpus=0, get_if_exists=True,
        max_concurrency=64,
    )
    if detached:
        options["lifetime"] = "detached"
    if on_head_node:
        # Ray gives the head node this marker resource; the directory lives as long as the cluster
        options["resources"] = {"node:__internal_head__": 0.001}
    return ray.remote(Coordinator).options(**options).remote(**kwargs)


def get_coordinator() -> Any:
    return ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
