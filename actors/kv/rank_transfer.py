"""Everything one rank does to move KV: the code path shared by vLLM and the synthetic engine.

A reader rank plans a remote engine once per shape at first contact (`peer_book.PeerBook`),
then posts one READ per source rank per pull, confirms the producers' leases (`lease.confirm`) and
permutes the blocks into its own layout; a producer rank holds and releases leases
(`lease.producer.LeaseKeeper`). Invariants: nothing reaches the wire unless every block id is
valid; a pull is done only when every source's lease record read HELD (and its checksums match),
else it fails closed and every producer hears it at once; `step()` is the one place that decides
what a step polls, and nothing here starts a thread or spins. The life cycles: `RankTransfer`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from actors.kv.lease.confirm import EXPIRED, MISSING, Confirmer, SourceConfirm
from actors.kv.plan.descriptors import checked_block_ids
from actors.kv.transfer_errors import KVTransferError
from actors.kv.faults import NO_FAULTS, FaultPolicy, InjectedFault
from actors.kv.handshake import CompatInfo, RankHandshake
from actors.kv.lease.integrity import check_mode
from actors.kv.plan.layout import CacheGeometry, to_local_layout
from actors.kv.lease.lease_board import lease_tag
from actors.kv.lease.notify import ReaderNotice
from actors.kv.lease.producer import LeaseKeeper, new_board
from actors.kv.peer_book import HandshakeDirectory, PeerBook
from actors.kv.plan.pull_plan import PeerKey, PeerPlan, StagePlan
from actors.kv.plan.pull_types import (INTEGRITY, LEASE_ENDED, NO_LEASE_RECORD, PullRequest, PullTiming, RankIdentity,
                                  Shape, StepResult)
from actors.kv.plan.topology import TransferTopology, rank_global_heads
from actors.kv.transport import TransportBase

logger = logging.getLogger("raypd.transfer")


@dataclass
class _Pull:
    req: PullRequest
    started: float
    local_ids: np.ndarray | None = None
    remote_ids: np.ndarray | None = None
    plan: PeerPlan | None = None
    sources: tuple[PeerKey, ...] = ()  # every rank told about this pull
    confirming: bool = False  # data READs done; reading the lease records
    retry_at: float | None = None  # no record yet: READ it again then
    retries: int = 0
    data_s: float = 0.0



class RankTransfer:
    """Life cycle of a request on a decode (reader) rank:

      1. start_pull  the first request of a shape (remote engine, tp, pp, dcp)
                     handshakes (`connect`): payloads of exactly the ranks
                     `handshake_target_ranks` names, peers added and connected,
                     descriptor lists prepared (`PeerPlan`, cached), and for every
                     source rank the lists of its lease board (`actors.kv.lease.confirm`).
                     Every request then checks its block ids against both sides'
                     block counts (vectorised), computes descriptor indices and
                     posts one READ per source rank; replicas we skip are told at
                     once. Nothing reaches the wire unless every id is valid;
      2. step        data READs done -> the lease confirmation is READ from every
                     source's board (the record, plus checksums with
                     `transfer.verify`); HELD everywhere -> the blocks are permuted
                     into the local layout (block-size ratio, HND/NHD), checked
                     against the checksums, the sources are notified and the pull
                     is reported done. RELEASED, no record within the read timeout,
                     a checksum mismatch or any READ error fails the pull: its
                     blocks are reported invalid and every source gets an ok=false
                     notice, so producers free at once (fail closed);
      3. abandon     a request that will never pull tells its producers the same.

    On a prefill (producer) rank, `hold` / `release` and the lease part of `step`
    are `actors.kv.lease.producer.LeaseKeeper`'s (its class docstring has that life cycle).

    `step()` polls pulls, then leases with the notices that arrived, and returns a `StepResult`;
    the owner calls it (vLLM: every engine step) while `needs_step`. Moving bytes does not wait for
    it: NIXL's progress thread (`actors.kv.nixl.nixl_binding`) serves peers' READs of this rank's
    memory and board meanwhile, so a producer owes its readers nothing between its steps.
    """

    def __init__(self, identity: RankIdentity, geometry: CacheGeometry, planes: list[list[torch.Tensor]],
                 compat: CompatInfo, transport: TransportBase, is_mla: bool = False, faults: FaultPolicy = NO_FAULTS,
                 clock: Callable[[], float] = time.monotonic, early_notice_ttl_s: float = 60.0,
                 verify: str = "off"):
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
        self.verify = check_mode(verify)
        self._clock = clock
        head0 = rank_global_heads(identity.tp_rank, identity.tp_size, compat.num_kv_heads, is_mla)[0]
        self.board = new_board(geometry, identity.role, verify, transport)
        self.keeper = LeaseKeeper(geometry, planes, head0, verify, self.board, faults, clock, early_notice_ttl_s)
        self.leases = self.keeper.leases
        self.confirmer = Confirmer(transport, geometry.num_blocks, verify, with_sums=verify != "off")
        self.peers = PeerBook(identity.reader_name, geometry, compat, transport, self.topology, self.confirmer)
        self._pulls: dict[str, _Pull] = {}
        self.timings: dict[str, PullTiming] = {}  # the last finished pulls (bounded)
        self.integrity = {"checked_blocks": 0, "mismatched_pulls": 0, "unverifiable": 0}

    def handshake(self) -> bytes:
        i = self.identity
        return RankHandshake(
            engine_id=i.engine_id, role=i.role, tp_rank=i.tp_rank, tp_size=i.tp_size,
            pp_rank=i.pp_rank, pp_size=i.pp_size, dcp_size=i.dcp_size, block_size=i.block_size,
            agent_name=self.transport.name, agent_metadata=self.transport.metadata(),
            geometry=self.geometry, compat=self.compat,
            board=self.board.info() if self.board is not None else None,
        ).encode()

    # -------------------------------------------------------------- handshake
    def connect(self, shape: Shape, directory: HandshakeDirectory) -> PeerPlan:
        """First contact with a remote engine of this shape (`PeerBook.connect`); cached."""
        return self.peers.connect(shape, directory)

    def refresh_peers(self, agents: dict[PeerKey, str]) -> None:
        """Forget an engine whose ranks now answer under other agent names (it restarted)."""
        self.peers.refresh(agents)

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
            remote_ids = pull.remote_ids = checked_block_ids("remote", req.remote_block_ids, plan.remote_num_blocks)
            posts = [(stage, src, *src.indices(local_ids, remote_ids, req.num_tokens))
                     for stage in plan.stages for src in stage.reads]  # every index, before any post
            for stage, src, li, ri, nbytes, spans in posts:  # notices follow the confirmation
                self.transport.start_read(req_id, src.key, src.local, li, src.remote, ri, b"", nbytes, spans)
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

    def fail_pull(self, req_id: str, reason: str) -> None:
        """End a pull now as failed: the next `step` reports it and tells its producers, as for a
        pull the transport failed."""
        if req_id in self._pulls:
            self.transport.fail_request(req_id, reason)

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
        index = torch.from_numpy(pull.local_ids[:n_blocks]).to(self.planes[0][0].device)
        for stage in stages:
            for layer in stage.transform_layers:
                for plane in self.planes[layer - self.geometry.first_layer]:
                    to_local_layout(plane, index, stage.remote_layout, self.geometry.layout, stage.ratio)

    # ------------------------------------------------------------------ step
    def _lease_id(self, pull: _Pull, req_id: str) -> str:
        return pull.req.remote_request_id or req_id

    def _read_sources(self, pull: _Pull) -> list[SourceConfirm]:
        return [self.peers.confirms[src.key] for stage in pull.plan.stages for src in stage.reads]

    def _confirm(self, req_id: str, pull: _Pull) -> None:
        """READ every source's lease record (and the checksums we check)."""
        pull.confirming, pull.retry_at = True, None
        self.confirmer.post(req_id, self._read_sources(pull), lease_tag(self._lease_id(pull, req_id)),
                            pull.local_ids, pull.remote_ids)

    def _finish(self, req_id: str, pull: _Pull, now: float) -> str | None:
        """A pull whose confirmation READs landed: None when done, else why it failed (or MISSING)."""
        tag = lease_tag(self._lease_id(pull, req_id))
        sources = self._read_sources(pull)
        state, modes = self.confirmer.outcome(sources, tag, int(pull.local_ids[0]))
        if state == EXPIRED:
            return LEASE_ENDED
        if state == MISSING:
            return MISSING
        confirmed = now
        self._to_local_layout(pull)
        t0 = time.perf_counter()
        bad, checked, unverifiable = self.confirmer.mismatches(
            sources, modes, tag, self.planes, self.geometry.layout, self.geometry.first_layer,
            pull.local_ids, pull.remote_ids)
        verify_s = time.perf_counter() - t0
        self.integrity["checked_blocks"] += checked
        self.integrity["unverifiable"] += unverifiable
        if bad:
            self.integrity["mismatched_pulls"] += 1
            return f"{INTEGRITY}: " + "; ".join(bad)
        for stage in pull.plan.stages:
            for src in stage.reads:
                self._send_quietly(src.key, self._notice(pull, req_id, stage.consumers, True))
        self.timings[req_id] = PullTiming(pull.data_s, confirmed - pull.started - pull.data_s, verify_s, checked)
        while len(self.timings) > 256:
            self.timings.pop(next(iter(self.timings)))
        return None

    def _advance(self, done: dict[str, float], failed: dict[str, str]) -> bool:
        """One poll of the transport; True when confirmation READs were posted."""
        polled = self.transport.poll()
        now = self._clock()
        posted = False
        for req_id in polled.done:
            pull = self._pulls.get(req_id)
            if pull is None:
                continue
            try:
                if not pull.confirming:
                    pull.data_s = now - pull.started
                    self._confirm(req_id, pull)
                    posted = True
                    continue
                outcome = self._finish(req_id, pull, now)
            except (KVTransferError, ValueError, RuntimeError) as exc:
                outcome = f"confirming the read failed: {type(exc).__name__}: {exc}"
            if outcome is None:
                done[req_id] = now - self._pulls.pop(req_id).started
            elif outcome == MISSING and now - pull.started <= self.transport.read_timeout_s:
                pull.retry_at, pull.retries = now + min(0.05, 0.001 * 2 ** pull.retries), pull.retries + 1
            elif outcome == MISSING:
                failed[req_id] = f"{NO_LEASE_RECORD} {self.transport.read_timeout_s:.1f}s"
            else:
                failed[req_id] = outcome
        failed.update(polled.failed)
        for req_id, pull in self._pulls.items():
            if pull.retry_at is not None and pull.retry_at <= now and req_id not in failed:
                try:
                    self._confirm(req_id, pull)
                    posted = True
                except (KVTransferError, ValueError) as exc:
                    failed[req_id] = f"confirming the read failed: {exc}"
        return posted

    def step(self) -> StepResult:
        """Advance pulls and leases once; report everything that finished."""
        done: dict[str, float] = {}
        failed: dict[str, str] = {}
        invalid: dict[str, tuple[int, ...]] = {}
        if self._pulls or self.transport.in_flight():
            if self._advance(done, failed):
                self._advance(done, failed)  # a confirmation often lands at once: no need to wait a step
            for req_id, reason in failed.items():
                pull = self._pulls.pop(req_id, None)
                self.transport.cancel(req_id)
                invalid[req_id] = tuple(int(b) for b in pull.req.local_block_ids) if pull else ()
                for key in (pull.sources if pull else ()):
                    self._send_quietly(key, self._notice(pull, req_id, 1, False))
        notices = self.transport.get_notifs() if self.keeper.wants_notices else []
        released, expired = self.keeper.step(notices)
        return StepResult(done, failed, invalid, tuple(released), tuple(expired))

    @property
    def needs_step(self) -> bool:
        """Whether `step()` has anything to report or release (pulls, leases, early notices)."""
        return bool(self._pulls or self.keeper.busy)

    def set_verify(self, mode: str) -> None:
        """Switch `transfer.verify` (checksums need a rank built with verify on: it owns their memory)."""
        self.verify = self.keeper.verify = self.confirmer.verify = check_mode(mode)

    # -------------------------------------------------------------- producer
    def hold(self, req_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """Lease the blocks and publish the lease (a release by early notices shows in `step()`)."""
        self.keeper.hold(req_id, block_ids, ttl_s)

    def release(self, req_id: str) -> list[int]:
        """Free a request's lease now; the next `step()` reports it released."""
        return self.keeper.release(req_id)

    # ------------------------------------------------------------- lifecycle
    def drop_engine(self, engine_id: str) -> int:
        """Forget a remote engine (it died or restarted): plans, topology, peers."""
        return self.peers.drop_engine(engine_id)

    @property
    def pulls_in_flight(self) -> int:
        return len(self._pulls)

    def stats(self) -> dict:
        s = self.transport.stats
        return {
            "agent": self.transport.name,
            "leases": self.keeper.counters(),
            "integrity": dict(self.integrity),
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
