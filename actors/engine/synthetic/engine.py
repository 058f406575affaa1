"""A synthetic engine: tp x pp rank actors, one block pool, leases and pulls.

What a vLLM engine does to KV, without a model: prefill writes and leases blocks on every rank,
decode pulls every rank's read plan and folds the ranks' outcomes into one verdict
(`KVOutputAggregator`), and tokens are derived from the checksums of what was read, so a wrong
byte shows as a wrong token. Invariants: one block id list is shared by every rank (as vLLM does);
a prefill's blocks return to the pool only once every rank's lease is released; a rank's death
voids every lease and pull of the incarnation before it (`RankSupervision`). Async so it can live
inside an engine actor; tests drive it with asyncio.run. The life cycle of a request:
`SyntheticEngine`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import ray

from actors.kv.aggregator import KVConnectorOutput, KVOutputAggregator
from actors.kv.faults import FaultPolicy
from actors.engine.ledger_reporter import LedgerReporter
from actors.engine.synthetic.block_pool import BlockPool
from actors.engine.synthetic.pattern import tokens_from_checksums
from actors.engine.synthetic.rank import FailedPull, PulledKV, RankConfig, RankPoll, SyntheticModel
from actors.engine.synthetic.outcomes import TransferFailed, is_handshake_failure, ordered_checksums
from actors.engine.synthetic.rank_actor import RANK_MAX_RESTARTS, RankActor
from actors.engine.synthetic.rank_supervision import RankSupervision
from actors.protocol.registration import EngineInfo
from actors.transfer_params import TransferParams

logger = logging.getLogger("raypd.synthetic")


@dataclass(frozen=True)
class EngineShape:
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    block_size: int = 16
    num_blocks: int = 256
    layout: str = "HND"


class SyntheticEngine(RankSupervision):
    """Life cycle of a request:

      prefill   blocks are allocated (one id list shared by every rank, as vLLM
                does), every rank writes its share, every rank holds the blocks
                under a lease; the transfer params are returned;
      decode    blocks are allocated, every rank pulls its read plan; per-rank
                outcomes are aggregated (`KVOutputAggregator`) into one verdict;
                tokens are derived from the checksums of what was read; the
                decode blocks are freed;
      release   the prefill engine frees a request's blocks once every rank's
                lease is released (readers notified, aborted or expired);
                `poll()` drives this and must be called while leases are held;
      abort     frees a request's blocks on this engine at once (prefill: its
                lease on every rank; decode: its pull).

    Life cycle of the engine's ranks: each rank actor is restarted by Ray when it
    dies, at most `rank_max_restarts` times (the deployment's `restarts.max_restarts`). The engine keeps one pending `watch()` call per rank, so
    a death is seen at once: held prefill blocks are freed (their KV is gone with
    the rank), pulls in flight fail (what their step had collected is salvaged
    through the coordinator's `unit_died`), and once the rank is back with a fresh
    NIXL agent the engine is a new incarnation: `on_new_incarnation` registers its
    new handshakes.

    Async so it can live inside an engine actor; tests drive it with asyncio.run.
    """

    def __init__(self, engine_id: str, role: str, model: SyntheticModel, shape: EngineShape,
                 coordinator: Any = None, lease_ttl_s: float = 30.0, read_timeout_s: float = 30.0,
                 register: bool = True, fault_rate: float = 0.0, verify: str = "off",
                 on_new_incarnation: Callable[[], Awaitable[Any]] | None = None, ledger: LedgerReporter | None = None,
                 rank_max_restarts: int = RANK_MAX_RESTARTS):
        self.engine_id, self.role, self.model, self.shape = engine_id, role, model, shape
        self.coordinator = coordinator
        # transfer outcomes to the coordinator's ledger (the engine actor's reporter, or our own: each tick)
        self.ledger = ledger or (LedgerReporter(engine_id, lambda: self.coordinator, max_delay_s=0.0)
                                 if coordinator is not None else None)
        self.register = register
        self.on_new_incarnation = on_new_incarnation or (self._register if register else None)
        self.lease_ttl_s = lease_ttl_s
        self.pool = BlockPool(shape.num_blocks)
        faults = FaultPolicy(rate=fault_rate)  # test knob: this fraction of pulls fails on purpose
        self.ranks = [
            RankActor.options(num_cpus=0, max_restarts=rank_max_restarts, max_task_retries=0).remote(
                RankConfig(engine_id=engine_id, role=role, model=model, tp_rank=t, tp_size=shape.tp_size,
                           pp_rank=p, pp_size=shape.pp_size, dcp_size=shape.dcp_size,
                           block_size=shape.block_size, num_blocks=shape.num_blocks,
                           layout=shape.layout, read_timeout_s=read_timeout_s, verify=verify),
                coordinator, faults,
            )
            for p in range(shape.pp_size) for t in range(shape.tp_size)
        ]
        self._held: dict[str, tuple[list[int], set[int]]] = {}  # req -> (blocks, ranks still holding)
        # rank.poll() drains every request's pull outcome; concurrent decodes (and the lease
        # pump) share one drain, so outcomes are parked here per rank until their request asks.
        self._pull_outcomes: list[dict[str, PulledKV | FailedPull]] = [{} for _ in self.ranks]
        self._pump: asyncio.Task | None = None
        self.pump_interval_s = 0.01  # lease polling: how soon released blocks return to the pool
        self.closed = False
        self.incarnation = 0  # bumped when a rank died: every pull and lease before it is void
        self.dead: str | None = None  # a rank could not be restarted: this engine cannot serve
        self._ready = asyncio.Event()
        self._replacing = 0  # ranks being replaced right now
        self._rank_watchers: list[asyncio.Task] = []
        self.rank_pids: list[int] = []

    async def start(self) -> dict:
        """Collect handshakes, watch the ranks, register with the coordinator; returns pair verdicts."""
        self.handshakes = list(await asyncio.gather(*(r.handshake.remote() for r in self.ranks)))
        self.rank_pids = list(await asyncio.gather(*(r.pid.remote() for r in self.ranks)))
        self._ready.set()
        loop = asyncio.get_running_loop()
        self._rank_watchers = [loop.create_task(self._watch_rank(i)) for i in range(len(self.ranks))]
        if self.coordinator is None or not self.register:
            return {}
        return (await self._register()).pairs

    async def _register(self) -> Any:
        return await self.coordinator.register_engine.remote(
            self.engine_id, self.role, list(self.handshakes), self.ranks,
            EngineInfo(backend="synthetic", pid=os.getpid()),
        )

    def blocks_for(self, num_tokens: int) -> int:
        slots = math.ceil(num_tokens / self.shape.dcp_size)
        return math.ceil(slots / self.shape.block_size)

    # ------------------------------------------------------------ prefill
    async def _serving(self) -> None:
        """Wait out a rank replacement; refuse when the engine cannot serve anymore."""
        await self._ready.wait()
        if self.dead is not None:
            raise RuntimeError(f"{self.engine_id}: {self.dead}")

    async def prefill(self, req_id: str, token_ids: list[int], seed: int = 0) -> dict:
        await self._serving()
        block_ids = self.pool.allocate(self.blocks_for(len(token_ids)))
        try:
            await asyncio.gather(*(
                r.write_prompt.remote(req_id, token_ids, block_ids, seed, self.lease_ttl_s) for r in self.ranks
            ))
        except Exception:
            await asyncio.gather(*(r.abort.remote(req_id) for r in self.ranks), return_exceptions=True)
            self.pool.free(block_ids)
            raise
        self._held[req_id] = (block_ids, set(range(len(self.ranks))))
        self._ensure_pump()
        return {
            "remote_engine_id": self.engine_id, "remote_block_ids": block_ids,
            "num_tokens": len(token_ids), "tp_size": self.shape.tp_size, "pp_size": self.shape.pp_size,
            "dcp_size": self.shape.dcp_size, "block_size": self.shape.block_size,
            "lease_expiry": time.time() + self.lease_ttl_s,
            "remote_request_id": req_id,  # names the lease whose record readers confirm
        }

    async def poll(self) -> list[str]:
        """Free blocks of requests every rank released; returns their ids."""
        if not self._held:
            return []
        outs = await self._poll_ranks()
        freed = []
        for i, out in enumerate(outs):
            if isinstance(out, BaseException):
                continue  # a dead rank: its watcher frees what it held
            for req_id in out.released + out.expired:
                held = self._held.get(req_id)
                if held is None:
                    continue
                held[1].discard(i)
                if not held[1]:
                    self.pool.free(held[0])
                    del self._held[req_id]
                    freed.append(req_id)
        return freed

    def _ensure_pump(self) -> None:
        """Poll the prefill ranks while they hold leases, and only then.

        Readers' READs and notices do not need this (each rank's NIXL progress
        thread serves them); the poll turns the notices that arrived into
        released leases and expires the rest. An engine holding no leases is
        not polled.
        """
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        while self._held and not self.closed:
            try:
                await self.poll()
            except ray.exceptions.RayError as exc:
                logger.warning("%s: polling ranks failed: %s", self.engine_id, exc)
            await asyncio.sleep(self.pump_interval_s)

    async def wait_released(self, req_id: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while req_id in self._held:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.engine_id}: {req_id} still holds blocks after {timeout_s}s")
            self._ensure_pump()
            await asyncio.sleep(0.005)

    async def abort(self, req_id: str, ranks: list[Any] | None = None) -> None:
        """Free a request now: its lease on every rank (an unread prefill) or its pull. The
        blocks go back to the pool only once no rank serves them to a reader anymore."""
        targets = self.ranks if ranks is None else ranks
        await asyncio.gather(*(r.abort.remote(req_id) for r in targets), return_exceptions=True)
        held = self._held.pop(req_id, None)
        if held is not None:
            self.pool.free(held[0])

    # ------------------------------------------------------------- decode
    async def decode(self, req_id: str, parsed: TransferParams, token_ids: list[int], seed: int = 0,
                     max_tokens: int = 8, timeout_s: float = 60.0) -> dict:
        """Pull the prompt's KV from the prefill engine and 'generate' from it."""
        await self._serving()
        block_ids = self.pool.allocate(self.blocks_for(len(token_ids)))
        try:
            await asyncio.gather(*(
                r.start_pull.remote(req_id, parsed, token_ids, block_ids, seed) for r in self.ranks
            ))
            per_rank = await self._await_pulls(req_id, parsed.remote_engine_id, timeout_s)
        except BaseException:
            await asyncio.gather(*(r.abort.remote(req_id) for r in self.ranks), return_exceptions=True)
            raise
        finally:
            self.pool.free(block_ids)
            for parked in self._pull_outcomes:  # nothing of this request stays parked
                parked.pop(req_id, None)
        checksums: dict[int, float] = {}
        for out in per_rank:
            for pos, value in out.checksums.items():
                checksums[int(pos)] = checksums.get(int(pos), 0.0) + value
        ordered = [checksums[p] for p in sorted(checksums)]
        return {
            "token_ids": tokens_from_checksums(ordered, max_tokens, self.model.vocab_size),
            "mismatches": sum(out.mismatches for out in per_rank),
            "checksums": ordered,
        }

    async def _poll_ranks(self) -> list[RankPoll | BaseException]:
        """One step of every rank; a dead rank's entry is its exception."""
        outs = await asyncio.gather(*(r.poll.remote() for r in self.ranks), return_exceptions=True)
        for parked, out in zip(self._pull_outcomes, outs):
            if isinstance(out, BaseException):
                continue
            parked.update(out.finished)
            parked.update(out.failed)
        return outs

    async def _await_pulls(self, req_id: str, prefill_id: str, timeout_s: float) -> list[PulledKV]:
        """Step the ranks until every one has an outcome for `req_id`; each step's outcomes
        go to the coordinator's ledger (one report per step, one entry per rank)."""
        n = len(self.ranks)
        aggregator = KVOutputAggregator(n)
        results: dict[int, PulledKV] = {}
        failures: dict[int, FailedPull] = {}
        reported: set[int] = set()  # ranks whose outcome reached the ledger
        epoch = self.incarnation
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            outs = await self._poll_ranks()
            rank_outputs = [KVConnectorOutput(expected_finished_count=n) for _ in range(n)]
            for i, (parked, out_i) in enumerate(zip(self._pull_outcomes, rank_outputs)):
                res = parked.pop(req_id, None)
                if isinstance(res, PulledKV):
                    results[i] = res
                    out_i.finished_recving.add(req_id)
                elif isinstance(res, FailedPull):
                    failures[i] = res
                    out_i.finished_recving.add(req_id)
                    out_i.failed_recving.add(req_id)
                    out_i.invalid_block_ids.update(res.invalid_block_ids)
            dead = [i for i, out in enumerate(outs) if isinstance(out, BaseException)]
            if dead or self.incarnation != epoch:
                self._salvage(req_id, rank_outputs, reported)
                raise TransferFailed(req_id, [f"decode rank(s) {dead or 'of an earlier incarnation'} died "
                                              "mid-pull"], set())
            verdict = aggregator.aggregate(rank_outputs)
            if self.ledger is not None and any(not o.is_empty() for o in rank_outputs):
                for i, res in failures.items():
                    if i not in reported and is_handshake_failure(res.reason):
                        self.ledger.handshake_failed(prefill_id, res.reason, req_id)
                        break
                self.ledger.outcomes(rank_outputs)
            reported.update(i for i, o in enumerate(rank_outputs) if not o.is_empty())
            if req_id in verdict.finished_recving:
                if req_id in verdict.failed_recving:
                    raise TransferFailed(req_id, [f.reason for f in failures.values()],
                                         set(verdict.invalid_block_ids))
                return [results[i] for i in range(n)]
            if time.monotonic() > deadline:
                raise TransferFailed(req_id, [f"no verdict after {timeout_s}s"], set())
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _salvage(self, req_id: str, collected: list[KVConnectorOutput], reported: set[int]) -> None:
        """A rank died mid-step: what this step collected is handed to the ledger's
        `unit_died` (stashed and replayed), and every rank that never reported `req_id`
        reports it failed, so its verdict completes now, exactly once."""
        for i, out in enumerate(collected):
            if i not in reported and req_id not in out.finished_recving:
                out.finished_recving.add(req_id)
                out.failed_recving.add(req_id)
        if self.ledger is not None:
            self.ledger.unit_died(collected)

    async def read_prompt(self, token_ids: list[int], block_ids: list[int], seed: int = 0) -> list[float]:
        """Per-position checksums of a prompt's KV as this engine holds it (every rank's share)."""
        outs = await asyncio.gather(*(r.read_back.remote(token_ids, block_ids, seed) for r in self.ranks))
        return ordered_checksums(sums for _, sums in outs)

    async def generate_local(self, req_id: str, token_ids: list[int], seed: int = 0,
                             max_tokens: int = 8) -> dict:
        """Colocated reference: prefill and 'decode' on this engine, no transfer."""
        await self._serving()
        block_ids = self.pool.allocate(self.blocks_for(len(token_ids)))
        try:
            await asyncio.gather(*(r.write_prompt.remote(req_id, token_ids, block_ids, seed) for r in self.ranks))
            outs = await asyncio.gather(*(r.read_back.remote(token_ids, block_ids, seed) for r in self.ranks))
        finally:
            self.pool.free(block_ids)
        ordered = ordered_checksums(sums for _, sums in outs)
        return {"token_ids": tokens_from_checksums(ordered, max_tokens, self.model.vocab_size),
                "checksums": ordered}

    # ---------------------------------------------------------- lifecycle
    async def rank_stats(self) -> list[dict]:
        """The live ranks' counters (a rank that is dead or restarting is left out, not waited for)."""
        found = await asyncio.gather(*(r.stats.remote() for r in self.ranks), return_exceptions=True)
        return [s for s in found if isinstance(s, dict)]

    def stats(self) -> dict:
        return {"engine_id": self.engine_id, "role": self.role, "free_blocks": self.pool.num_free,
                "num_blocks": self.pool.num_blocks, "held_requests": len(self._held),
                "incarnation": self.incarnation, "rank_pids": list(self.rank_pids)}

    async def shutdown(self) -> list[dict]:
        """Release every rank's NIXL resources, unregister, kill the rank actors."""
        if self.closed:
            return []
        self.closed = True
        if self._pump is not None:
            self._pump.cancel()
        for task in self._rank_watchers:
            task.cancel()
        results = await asyncio.gather(*(r.shutdown.remote() for r in self.ranks), return_exceptions=True)
        if self.coordinator is not None and self.register:
            try:
                await self.coordinator.unregister_engine.remote(self.engine_id, "shutdown")
            except ray.exceptions.RayError:
                pass
        for r in self.ranks:
            ray.kill(r)
        return [r for r in results if isinstance(r, dict)]
