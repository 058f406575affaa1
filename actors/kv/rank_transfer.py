"""Everything one rank does to move KV: the code path shared by vLLM and the synthetic engine.

Life cycle of a request on a decode (reader) rank:

  start_pull    the first request of a shape (remote engine, tp, pp, dcp)
                handshakes (`connect`): payloads of exactly the ranks
                `handshake_target_ranks` names, peers added and connected,
                descriptor lists prepared (`PeerPlan`, cached). Every request
                then checks its block ids against both sides' block counts
                (vectorised), computes descriptor indices and posts one READ
                per source rank, each carrying a notice; replicas we skip are
                told at once. Nothing reaches the wire unless every id is valid;
  step          finished pulls are permuted into the local layout (block-size
                ratio, HND/NHD) and reported done; a failed pull reports its
                blocks invalid and sends ok=false notices to every source, so
                producers free at once;
  abandon       a request that will never pull tells its producers the same.

Life cycle on a prefill (producer) rank:

  hold          the request's blocks go under a lease; notices that arrived
                before the lease (a fast reader) are applied at once;
  step          notices release leases (all readers heard, or a reader gave
                up); expired leases are released too;
  release       the engine frees a lease itself (abort, or a reader that will
                never come): reported by the next step like any release.

`step()` is the one place that decides what a step polls (pulls, then
leases with the notices that arrived) and returns everything it produced as a
`StepResult`. Nothing here starts a thread or spins: the owner calls `step()`
(vLLM: every engine step) while `needs_step`. Moving bytes does not wait for
`step()`: NIXL's progress thread (`actors.kv.nixl_binding`) serves peers'
READs of this rank's memory, sends our notices and collects theirs even while
the owner is busy; `step()` decides what finished and what to release.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from actors.kv.descriptors import checked_block_ids
from actors.kv.errors import HandshakeError, KVTransferError
from actors.kv.faults import NO_FAULTS, FaultPolicy, InjectedFault
from actors.kv.handshake import CompatInfo, RankHandshake, decode_handshake
from actors.kv.layout import CacheGeometry, compatible_geometry, to_local_layout
from actors.kv.lease import LeaseTable
from actors.kv.notify import ReaderNotice, decode_notice
from actors.kv.pull_plan import PeerPlan, PeerKey, StagePlan, build_stage
from actors.kv.read_plan import plan_reads
from actors.kv.pull_types import PullRequest, RankIdentity, Shape, StepResult
from actors.kv.topology import EngineTransferInfo, TransferTopology

logger = logging.getLogger("raypd.transfer")

# (engine id, pp rank, tp ranks) -> encoded handshake payloads of those ranks
HandshakeDirectory = Callable[[str, int, list[int]], list[bytes]]


@dataclass
class _Pull:
    req: PullRequest
    started: float
    local_ids: np.ndarray | None = None
    plan: PeerPlan | None = None
    sources: tuple[PeerKey, ...] = ()  # every rank told about this pull


class RankTransfer:
    def __init__(self, identity: RankIdentity, geometry: CacheGeometry, planes: list[list[torch.Tensor]],
                 compat: CompatInfo, transport, is_mla: bool = False, faults: FaultPolicy = NO_FAULTS,
                 clock: Callable[[], float] = time.monotonic, early_notice_ttl_s: float = 60.0):
        self.identity = identity
        self.geometry = geometry
        self.planes = planes  # [local layer][plane] -> [num_blocks, *block dims] view
        self.compat = compat
        self.transport = transport
        self.faults = faults
        self.topology = TransferTopology(
            tp_rank=identity.tp_rank, tp_size=identity.tp_size, block_size=identity.block_size,
            engine_id=identity.engine_id, is_mla=is_mla, is_mamba=False,
            total_num_kv_heads=compat.num_kv_heads, dcp_size=identity.dcp_size,
        )
        self.leases = LeaseTable(clock=clock)
        self._clock = clock
        self._plans: dict[Shape, PeerPlan] = {}
        self._pulls: dict[str, _Pull] = {}
        self._early: dict[str, tuple[float, list[ReaderNotice]]] = {}
        self._released: list[str] = []  # freed outside step(), reported by the next step()
        self.early_notice_ttl_s = early_notice_ttl_s

    def handshake(self) -> bytes:
        i = self.identity
        return RankHandshake(
            engine_id=i.engine_id, role=i.role, tp_rank=i.tp_rank, tp_size=i.tp_size,
            pp_rank=i.pp_rank, pp_size=i.pp_size, dcp_size=i.dcp_size, block_size=i.block_size,
            agent_name=self.transport.name, agent_metadata=self.transport.metadata(),
            geometry=self.geometry, compat=self.compat,
        ).encode()

    # -------------------------------------------------------------- handshake
    def connect(self, shape: Shape, directory: HandshakeDirectory) -> PeerPlan:
        """First contact with a remote engine of this shape: fetch payloads, add peers,
        connect, prepare descriptor lists. Cached; later requests only look it up."""
        plan = self._plans.get(shape)
        if plan is not None:
            return plan
        engine_id, tp_size, pp_size, dcp_size = shape
        if any(s[0] == engine_id for s in self._plans):  # another shape: a restarted engine
            self.drop_engine(engine_id)
        self.topology.unregister_remote_engine(engine_id)
        targets = self.topology.handshake_target_ranks(tp_size, dcp_size)
        stages = []
        for pp_rank in range(pp_size):
            payloads = directory(engine_id, pp_rank, targets)
            if len(payloads) != len(targets):
                raise HandshakeError("ranks", f"asked for ranks {targets}, got {len(payloads)} payloads")
            peers: dict[int, RankHandshake] = {}
            for data in payloads:
                hs = decode_handshake(data, expect_compat_hash=self.compat.compat_hash())
                if (hs.engine_id, hs.pp_rank, hs.tp_size, hs.dcp_size) != (engine_id, pp_rank, tp_size, dcp_size):
                    raise HandshakeError("engine_id", f"payload of {hs.key} does not match the request")
                compatible_geometry(self.geometry, hs.geometry)
                self.transport.add_peer(hs)
                peers[hs.tp_rank] = hs
            g, first = peers[targets[0]].geometry, peers[targets[0]]
            layers = (g.first_layer, g.first_layer + g.num_layers) if first.pp_size > 1 else (0, 0)
            self.topology.register_remote_engine(engine_id, EngineTransferInfo(
                remote_tp_size=tp_size, remote_block_len=g.block_bytes, remote_block_size=first.block_size,
                remote_physical_blocks_per_logical=1, remote_pp_rank=pp_rank,
                start_layer=layers[0], end_layer=layers[1], remote_dcp_size=dcp_size,
            ))
            stages.append(build_stage(self.transport, self.geometry, plan_reads(self.topology, engine_id, pp_rank),
                                      peers))
            # replicated: ranks holding the same KV are read once, the others only notified
            logger.info("%s connected to %s: %s, replicated=%s", self.identity.reader_name, engine_id,
                        self.topology.describe(engine_id, pp_rank),
                        self.topology.replicates_kv_cache(engine_id, pp_rank))
        plan = self._plans[shape] = PeerPlan(engine_id, tuple(stages))
        return plan

    def refresh_peers(self, agents: dict[PeerKey, str]) -> None:
        """Forget an engine whose ranks now answer under other agent names (it restarted)."""
        for key, name in agents.items():
            if self.transport.has_peer(key) and self.transport.peer(key).agent_name != name:
                self.drop_engine(key[0])
                return

    # ---------------------------------------------------------------- reader
    def _notice(self, pull: _Pull, req_id: str, consumers: int, ok: bool) -> bytes:
        lease_id = pull.req.remote_request_id or req_id
        return ReaderNotice(lease_id, self.identity.reader_name, consumers, ok).encode()

    def start_pull(self, req_id: str, req: PullRequest, directory: HandshakeDirectory) -> None:
        """Post every READ this rank needs; any error fails the request (never raises)."""
        pull = self._pulls[req_id] = _Pull(req, self._clock())
        try:
            if self.faults.fails(req_id):
                raise InjectedFault("fault injected on purpose (fault_rate)")
            plan = pull.plan = self.connect(req.shape, directory)
            pull.sources = tuple(key for stage in plan.stages for key in stage.notify)
            local_ids = pull.local_ids = checked_block_ids("local", req.local_block_ids, self.geometry.num_blocks)
            remote_ids = checked_block_ids("remote", req.remote_block_ids, plan.remote_num_blocks)
            posts = [(stage, src, *src.indices(local_ids, remote_ids, req.num_tokens))
                     for stage in plan.stages for src in stage.reads]  # every index, before any post
            for stage, src, li, ri, nbytes, spans in posts:
                notice = self._notice(pull, req_id, stage.consumers, True)
                self.transport.start_read(req_id, src.key, src.local, li, src.remote, ri, notice, nbytes, spans)
            for stage in plan.stages:
                for key in stage.skipped:  # replicas we do not read from free their copy now
                    self._send_quietly(key, self._notice(pull, req_id, stage.consumers, True))
            if not posts:
                self.transport.fail_request(req_id, "the read plan reads nothing")
        except (KVTransferError, ValueError) as exc:
            pull.sources = pull.sources or self._known_sources(req)  # they still hear we gave up
            self.transport.fail_request(req_id, f"{type(exc).__name__}: {exc}")

    def _known_sources(self, req: PullRequest) -> tuple[PeerKey, ...]:
        try:
            targets = self.topology.handshake_target_ranks(req.remote_tp_size, req.remote_dcp_size)
        except (KVTransferError, ValueError):
            return ()
        keys = ((req.remote_engine_id, p, r) for p in range(req.remote_pp_size) for r in targets)
        return tuple(k for k in keys if self.transport.has_peer(k))

    def abandon(self, req_id: str, req: PullRequest, directory: HandshakeDirectory) -> None:
        """Tell a request's producers it will never be read (aborted before loading)."""
        self.cancel(req_id)
        try:
            plan = self.connect(req.shape, directory)
        except (KVTransferError, ValueError) as exc:
            logger.info("abandoning %s: producers not reachable (%s); their lease will expire", req_id, exc)
            return
        pull = _Pull(req, self._clock())
        for stage in plan.stages:
            for key in stage.notify:
                self._send_quietly(key, self._notice(pull, req_id, 1, False))

    def cancel(self, req_id: str) -> None:
        self._pulls.pop(req_id, None)
        self.transport.cancel(req_id)

    def _send_quietly(self, key: PeerKey, msg: bytes) -> None:
        try:
            if self.transport.has_peer(key):
                self.transport.send_notif(key, msg)
        except KVTransferError as exc:  # the producer may be gone; its lease will expire
            logger.warning("notifying %s: %s", key, exc)

    def _to_local_layout(self, pull: _Pull) -> None:
        if pull.plan is None or pull.local_ids is None:
            return
        stages: list[StagePlan] = [s for s in pull.plan.stages if s.transform_layers]
        if not stages:
            return
        slots = math.ceil(pull.req.num_tokens / self.identity.dcp_size)
        n_blocks = min(pull.local_ids.size, math.ceil(slots / self.identity.block_size))
        index = torch.from_numpy(pull.local_ids[:n_blocks])
        for stage in stages:
            for layer in stage.transform_layers:
                for plane in self.planes[layer - self.geometry.first_layer]:
                    to_local_layout(plane, index, stage.remote_layout, self.geometry.layout, stage.ratio)

    # ------------------------------------------------------------------ step
    def step(self) -> StepResult:
        """Advance pulls and leases once; report everything that finished."""
        done: dict[str, float] = {}
        failed: dict[str, str] = {}
        invalid: dict[str, tuple[int, ...]] = {}
        if self._pulls or self.transport.in_flight():
            polled = self.transport.poll()
            now = self._clock()
            for req_id in polled.done:
                pull = self._pulls.pop(req_id, None)
                if pull is None:
                    continue
                try:
                    self._to_local_layout(pull)
                except (KVTransferError, ValueError, RuntimeError) as exc:
                    polled.failed[req_id] = f"layout transform failed: {exc}"
                    self._pulls[req_id] = pull
                    continue
                done[req_id] = now - pull.started
            for req_id, reason in polled.failed.items():
                pull = self._pulls.pop(req_id, None)
                failed[req_id] = reason
                invalid[req_id] = tuple(int(b) for b in pull.req.local_block_ids) if pull else ()
                for key in (pull.sources if pull else ()):
                    self._send_quietly(key, self._notice(pull, req_id, 1, False))
        released, self._released = self._released, []
        expired: list[str] = []
        if self.leases.held() or self._early:
            released += self._apply_notices()
            expired = [req_id for req_id, _ in self.leases.expire()]
        return StepResult(done, failed, invalid, tuple(released), tuple(expired))

    @property
    def needs_step(self) -> bool:
        """Whether `step()` has anything to report or release (pulls, leases, early notices)."""
        return bool(self._pulls or self.leases.held() or self._early or self._released)

    # -------------------------------------------------------------- producer
    def hold(self, req_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """Lease the blocks; notices that came first apply now (a release shows in `step()`)."""
        self.leases.grant(req_id, block_ids, readers=1, ttl_s=ttl_s)
        for notice in self._early.pop(req_id, (0.0, []))[1]:
            if self._apply(notice) is not None:
                self._released.append(req_id)

    def release(self, req_id: str) -> list[int]:
        """Free a request's lease now; the next `step()` reports it released."""
        self._early.pop(req_id, None)
        blocks = self.leases.release(req_id)
        if blocks:
            self._released.append(req_id)
        return blocks

    def _apply(self, notice: ReaderNotice) -> list[int] | None:
        if not notice.ok:
            return self.leases.release(notice.req_id) or None
        return self.leases.notify(notice.req_id, notice.reader, notice.readers_expected)

    def _apply_notices(self) -> list[str]:
        released: list[str] = []
        for msg in self.transport.get_notifs():
            notice = decode_notice(msg)
            if notice is None:
                continue
            if self.leases.get(notice.req_id) is None:
                # A reader faster than our lease grant: keep the notice for a while.
                self._early.setdefault(notice.req_id, (self._clock(), []))[1].append(notice)
                continue
            if self._apply(notice) is not None:
                released.append(notice.req_id)
        now = self._clock()
        for req_id in [r for r, (t, _) in self._early.items() if now - t > self.early_notice_ttl_s]:
            del self._early[req_id]
        return released

    # ------------------------------------------------------------- lifecycle
    def drop_engine(self, engine_id: str) -> int:
        """Forget a remote engine (it died or restarted): plans, topology, peers."""
        for shape in [s for s in self._plans if s[0] == engine_id]:
            del self._plans[shape]
        self.topology.unregister_remote_engine(engine_id)
        return self.transport.remove_engine(engine_id)

    @property
    def pulls_in_flight(self) -> int:
        return len(self._pulls)

    def stats(self) -> dict:
        s = self.transport.stats
        return {
            "agent": self.transport.name,
            "leases": self.leases.counters(),
            "pulls_in_flight": len(self._pulls),
            "transport_in_flight": self.transport.in_flight(),
            "peers": len(self.transport.peers()),
            "handshakes": s.handshakes,
            "lists_prepared": s.lists_prepared,
            "reads_posted": s.reads_posted,
            "descriptors_posted": s.descriptors_posted,
            "spans_posted": s.spans_posted,
            "bytes_posted": s.bytes_posted,
            "requests_done": s.requests_done,
            "requests_failed": s.requests_failed,
            "registered_regions": getattr(self.transport, "registered_regions", None),
        }

    def shutdown(self) -> dict:
        self._pulls.clear()
        self.transport.shutdown()
        return self.stats()
