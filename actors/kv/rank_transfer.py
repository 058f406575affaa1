"""Everything one rank does to move KV: the code path shared by vLLM and the synthetic engine.

Life cycle of a request on a decode (reader) rank:

  start_pull    handshake once per remote (engine, pp rank) with exactly the
                ranks `handshake_target_ranks` names (payloads come from the
                caller's directory), register them in the TransferTopology,
                build the read plan, turn it into bounds-checked byte runs and
                post one READ per source rank, each carrying a notice; replicas
                we skip are told at once (our polling for the READs drives that
                message out too);
  poll_pulls    finished pulls are permuted into the local layout (block-size
                ratio, HND/NHD) and reported; a failed pull sends ok=false
                notices to every source so producers free at once;
  abandon       a request that will never pull tells its producers the same.

Life cycle on a prefill (producer) rank:

  hold          the request's blocks go under a lease; notices that arrived
                before the lease (a fast reader) are applied at once;
  poll_leases   notices release leases (all readers heard, or a reader gave
                up); expired leases are released too.

No thread is started and nothing spins: progress happens when the owner
calls `poll_pulls` / `poll_leases` (vLLM: every engine step).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from actors.kv.errors import HandshakeError, KVTransferError
from actors.kv.handshake import CompatInfo, RankHandshake, decode_handshake
from actors.kv.layout import (
    BlockLayout,
    CacheGeometry,
    block_read_runs,
    compatible_geometry,
    to_local_layout,
    token_read_runs,
)
from actors.kv.lease import LeaseTable
from actors.kv.notify import ReaderNotice, decode_notice
from actors.kv.topology import EngineTransferInfo, TransferTopology
from actors.kv.transport import PeerKey

logger = logging.getLogger("raypd.transfer")

# (engine id, pp rank, tp ranks) -> encoded handshake payloads of those ranks
HandshakeDirectory = Callable[[str, int, list[int]], list[bytes]]


@dataclass(frozen=True)
class RankIdentity:
    engine_id: str
    role: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    dcp_size: int = 1
    block_size: int = 16

    @property
    def reader_name(self) -> str:
        return f"{self.engine_id}:{self.pp_rank}:{self.tp_rank}"


@dataclass(frozen=True)
class PullRequest:
    """What a reader needs to know of a request prefilled elsewhere."""

    remote_engine_id: str
    remote_block_ids: Sequence[int]
    remote_tp_size: int
    remote_pp_size: int
    remote_dcp_size: int
    local_block_ids: Sequence[int]
    num_tokens: int
    # The producer's id of this request, when it differs from ours (vLLM suffixes ids
    # per engine): notices must name the producer's lease.
    remote_request_id: str | None = None


@dataclass
class _Pull:
    req: PullRequest
    remote_layout: BlockLayout | None = None
    ratio: int = 1
    block_layers: set[int] = field(default_factory=set)
    sources: list[PeerKey] = field(default_factory=list)  # every rank told about this pull
    started: float = field(default_factory=time.monotonic)


@dataclass
class PullOutcome:
    done: dict[str, float] = field(default_factory=dict)  # req -> seconds
    failed: dict[str, str] = field(default_factory=dict)  # req -> reason
    invalid_block_ids: dict[str, list[int]] = field(default_factory=dict)


class RankTransfer:
    def __init__(self, identity: RankIdentity, geometry: CacheGeometry, planes: list[list[torch.Tensor]],
                 compat: CompatInfo, transport, is_mla: bool = False,
                 clock: Callable[[], float] = time.monotonic, early_notice_ttl_s: float = 60.0):
        self.identity = identity
        self.geometry = geometry
        self.planes = planes  # [local layer][plane] -> [num_blocks, *block dims] view
        self.compat = compat
        self.transport = transport
        self.topology = TransferTopology(
            tp_rank=identity.tp_rank, tp_size=identity.tp_size, block_size=identity.block_size,
            engine_id=identity.engine_id, is_mla=is_mla, is_mamba=False,
            total_num_kv_heads=compat.num_kv_heads, dcp_size=identity.dcp_size,
        )
        self.leases = LeaseTable(clock=clock)
        self._clock = clock
        self._pulls: dict[str, _Pull] = {}
        self._early: dict[str, tuple[float, list[ReaderNotice]]] = {}
        self.early_notice_ttl_s = early_notice_ttl_s

    # -------------------------------------------------------------- identity
    def handshake(self) -> bytes:
        i = self.identity
        return RankHandshake(
            engine_id=i.engine_id, role=i.role, tp_rank=i.tp_rank, tp_size=i.tp_size,
            pp_rank=i.pp_rank, pp_size=i.pp_size, dcp_size=i.dcp_size, block_size=i.block_size,
            agent_name=self.transport.name, agent_metadata=self.transport.metadata(),
            geometry=self.geometry, compat=self.compat,
        ).encode()

    # ---------------------------------------------------------------- reader
    def _connect(self, directory: HandshakeDirectory, engine_id: str, pp_rank: int,
                 tp_size: int, dcp_size: int) -> None:
        """Handshake with the remote ranks this rank needs, once per (engine, pp rank)."""
        targets = self.topology.handshake_target_ranks(tp_size, dcp_size)
        if all(self.transport.has_peer((engine_id, pp_rank, r)) for r in targets) and \
                (engine_id, pp_rank) in self.topology.remote_engines():
            return
        payloads = directory(engine_id, pp_rank, targets)
        if len(payloads) != len(targets):
            raise HandshakeError("ranks", f"asked for ranks {targets}, got {len(payloads)} payloads")
        info = None
        for data in payloads:
            hs = decode_handshake(data, expect_compat_hash=self.compat.compat_hash())
            if (hs.engine_id, hs.pp_rank, hs.tp_size, hs.dcp_size) != (engine_id, pp_rank, tp_size, dcp_size):
                raise HandshakeError("engine_id", f"payload of {hs.key} does not match the request")
            compatible_geometry(self.geometry, hs.geometry)
            self.transport.add_peer(hs)
            g = hs.geometry
            layers = (g.first_layer, g.first_layer + g.num_layers) if hs.pp_size > 1 else (0, 0)
            info = EngineTransferInfo(
                remote_tp_size=hs.tp_size, remote_block_len=g.block_bytes,
                remote_block_size=hs.block_size, remote_physical_blocks_per_logical=1,
                remote_pp_rank=pp_rank, start_layer=layers[0], end_layer=layers[1],
                remote_dcp_size=hs.dcp_size,
            )
        self.topology.unregister_remote_engine(engine_id, pp_rank)
        self.topology.register_remote_engine(engine_id, info)

    def _notice(self, req: PullRequest, req_id: str, consumers: int, ok: bool) -> bytes:
        lease_id = req.remote_request_id or req_id
        return ReaderNotice(lease_id, self.identity.reader_name, consumers, ok).encode()

    def start_pull(self, req_id: str, req: PullRequest, directory: HandshakeDirectory) -> None:
        """Post every READ this rank needs; a setup error fails the request (never raises)."""
        pull = _Pull(req)
        self._pulls[req_id] = pull
        engine_id = req.remote_engine_id
        try:
            for pp_rank in range(req.remote_pp_size):
                self._connect(directory, engine_id, pp_rank, req.remote_tp_size, req.remote_dcp_size)
                plan = self.topology.read_plan(engine_id, pp_rank)
                notice = self._notice(req, req_id, plan.consumers_per_remote_rank, True)
                read_ranks = set()
                for spec in plan.reads:
                    key = (engine_id, pp_rank, spec.remote_rank)
                    remote = self.transport.peer(key).geometry
                    if spec.token_shard is None:
                        runs = block_read_runs(spec, self.geometry, remote, req.local_block_ids, req.remote_block_ids)
                        pull.remote_layout, pull.ratio = remote.layout, spec.block_size_ratio
                        lo = max(self.geometry.first_layer, remote.first_layer)
                        hi = min(self.geometry.first_layer + self.geometry.num_layers,
                                 remote.first_layer + remote.num_layers)
                        pull.block_layers.update(range(lo, hi))
                    else:
                        runs = token_read_runs(spec, self.geometry, remote, req.local_block_ids,
                                               req.remote_block_ids, req.num_tokens)
                    self.transport.start_read(req_id, key, runs, notice)
                    read_ranks.add(spec.remote_rank)
                for r in plan.notify_ranks:
                    if r not in read_ranks:
                        # a replica we skip: tell it now, while our polling for the READs
                        # also drives this message out
                        self._send_quietly((engine_id, pp_rank, r), notice)
                pull.sources.extend((engine_id, pp_rank, r) for r in plan.notify_ranks)
        except (KVTransferError, ValueError) as exc:
            self.transport.fail_request(req_id, f"{type(exc).__name__}: {exc}")

    def poll_pulls(self) -> PullOutcome:
        out = PullOutcome()
        if not self._pulls:
            return out
        result = self.transport.poll()
        for req_id in result.done:
            pull = self._pulls.pop(req_id, None)
            if pull is None:
                continue
            self._to_local_layout(pull)
            out.done[req_id] = time.monotonic() - pull.started
        for req_id, reason in result.failed.items():
            pull = self._pulls.pop(req_id, None)
            out.failed[req_id] = reason
            out.invalid_block_ids[req_id] = list(pull.req.local_block_ids) if pull else []
            for key in (pull.sources if pull else []):
                self._send_quietly(key, self._notice(pull.req, req_id, 1, False))
        return out

    def fail_pull(self, req_id: str, req: PullRequest, reason: str) -> None:
        """Report a pull as failed without reading (fault injection, refused params).

        Producers we already know are told (ok=false) at the next poll.
        """
        pull = _Pull(req)
        for pp_rank in range(req.remote_pp_size):
            for r in self.topology.handshake_target_ranks(req.remote_tp_size, req.remote_dcp_size):
                pull.sources.append((req.remote_engine_id, pp_rank, r))
        self._pulls[req_id] = pull
        self.transport.fail_request(req_id, reason)

    def abandon(self, req_id: str, req: PullRequest, directory: HandshakeDirectory) -> None:
        """Tell a request's producers it will never be read (aborted before loading)."""
        self.cancel(req_id)
        try:
            for pp_rank in range(req.remote_pp_size):
                self._connect(directory, req.remote_engine_id, pp_rank, req.remote_tp_size, req.remote_dcp_size)
                for r in self.topology.handshake_target_ranks(req.remote_tp_size, req.remote_dcp_size):
                    self._send_quietly((req.remote_engine_id, pp_rank, r), self._notice(req, req_id, 1, False))
        except (KVTransferError, ValueError) as exc:
            logger.info("abandoning %s: producers not reachable (%s); their lease will expire", req_id, exc)

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
        if pull.remote_layout is None or not pull.block_layers:
            return
        if pull.remote_layout == self.geometry.layout and pull.ratio == 1:
            return
        slots = math.ceil(pull.req.num_tokens / self.identity.dcp_size)
        n_blocks = min(len(pull.req.local_block_ids), math.ceil(slots / self.identity.block_size))
        ids = list(pull.req.local_block_ids[:n_blocks])
        for layer in sorted(pull.block_layers):
            for plane in self.planes[layer - self.geometry.first_layer]:
                to_local_layout(plane, ids, pull.remote_layout, self.geometry.layout, pull.ratio)

    # -------------------------------------------------------------- producer
    def hold(self, req_id: str, block_ids: Sequence[int], ttl_s: float) -> list[int] | None:
        """Lease the blocks; returns them at once if every reader already reported."""
        self.leases.grant(req_id, block_ids, readers=1, ttl_s=ttl_s)
        released = None
        for notice in self._early.pop(req_id, (0.0, []))[1]:
            released = self._apply(notice) or released
        return released

    def _apply(self, notice: ReaderNotice) -> list[int] | None:
        if not notice.ok:
            return self.leases.release(notice.req_id) or None
        return self.leases.notify(notice.req_id, notice.reader, notice.readers_expected)

    def poll_leases(self) -> tuple[list[str], list[str]]:
        """(released by readers, expired) request ids since the last call."""
        released: list[str] = []
        for msg in self.transport.get_notifs():
            notice = decode_notice(msg)
            if notice is None:
                continue
            if self.leases.get(notice.req_id) is None:
                # A reader faster than our lease grant: keep the notice for a while.
                entry = self._early.setdefault(notice.req_id, (self._clock(), []))
                entry[1].append(notice)
                continue
            if self._apply(notice) is not None:
                released.append(notice.req_id)
        now = self._clock()
        for req_id in [r for r, (t, _) in self._early.items() if now - t > self.early_notice_ttl_s]:
            del self._early[req_id]
        expired = [req_id for req_id, _ in self.leases.expire()]
        return released, expired

    @property
    def has_early_notices(self) -> bool:
        return bool(self._early)

    def release(self, req_id: str) -> list[int]:
        return self.leases.release(req_id)

    # ------------------------------------------------------------- lifecycle
    def drop_engine(self, engine_id: str) -> int:
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
            "reads_posted": s.reads_posted,
            "descriptors_posted": s.descriptors_posted,
            "bytes_posted": s.bytes_posted,
            "requests_done": s.requests_done,
            "requests_failed": s.requests_failed,
            "registered_regions": getattr(self.transport, "registered_regions", None),
        }

    def shutdown(self) -> dict:
        self.transport.shutdown()
        return self.stats()
