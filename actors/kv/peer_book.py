"""The remote engines a reader rank has planned (`PeerBook`): one `PeerPlan` per shape.

A shape (remote engine, tp, pp, dcp) is planned at first contact: payloads of exactly the ranks
`handshake_target_ranks` names, peers added and connected, descriptor lists prepared, and for every
source rank the lists of its lease board (`actors.kv.lease.confirm`). Later requests only look the
plan up. An engine that restarted (another shape, or ranks under other agent names) is forgotten
first: plans, confirm lists, topology and peers go together.
"""

from __future__ import annotations

import logging
from typing import Callable

from actors.kv.handshake import CompatInfo, RankHandshake, decode_handshake
from actors.kv.lease.confirm import Confirmer, SourceConfirm
from actors.kv.plan.layout import CacheGeometry, compatible_geometry
from actors.kv.plan.pull_plan import PeerKey, PeerPlan, plan_stage
from actors.kv.plan.pull_types import Shape
from actors.kv.plan.topology import TransferTopology
from actors.kv.transfer_errors import HandshakeError
from actors.kv.transport import TransportBase

logger = logging.getLogger("raypd.transfer")

# (engine id, pp rank, tp ranks) -> encoded handshake payloads of those ranks
HandshakeDirectory = Callable[[str, int, list[int]], list[bytes]]


class PeerBook:
    """A reader rank's plans of remote engines and its source ranks' confirm lists."""

    def __init__(self, reader_name: str, geometry: CacheGeometry, compat: CompatInfo, transport: TransportBase,
                 topology: TransferTopology, confirmer: Confirmer):
        self.reader_name = reader_name
        self.geometry = geometry
        self.compat = compat
        self.transport = transport
        self.topology = topology
        self.confirmer = confirmer
        self.plans: dict[Shape, PeerPlan] = {}
        self.confirms: dict[PeerKey, SourceConfirm] = {}

    def connect(self, shape: Shape, directory: HandshakeDirectory) -> PeerPlan:
        """First contact with a remote engine of this shape: fetch payloads, add peers,
        connect, prepare descriptor lists. Cached; later requests only look it up."""
        plan = self.plans.get(shape)
        if plan is not None:
            return plan
        engine_id, tp_size, pp_size, dcp_size = shape
        if any(s[0] == engine_id for s in self.plans):  # another shape: a restarted engine
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
            stage = plan_stage(self.topology, self.transport, self.geometry, engine_id, pp_rank, peers)
            for src in stage.reads:
                self.confirms[src.key] = self.confirmer.prepare(
                    len(stages) * 64 + stage.reads.index(src), src, peers[src.key[2]].board, src.all_layers,
                    src.local_heads, src.remote_heads, src.remote_head0)
            stages.append(stage)
            # replicated: ranks holding the same KV are read once, the others only notified
            logger.info("%s connected to %s: %s, replicated=%s", self.reader_name, engine_id,
                        self.topology.describe(engine_id, pp_rank),
                        self.topology.replicates_kv_cache(engine_id, pp_rank))
        plan = self.plans[shape] = PeerPlan(engine_id, tuple(stages))
        return plan

    def refresh(self, agents: dict[PeerKey, str]) -> None:
        """Forget an engine whose ranks now answer under other agent names (it restarted)."""
        for key, name in agents.items():
            if self.transport.has_peer(key) and self.transport.peer(key).agent_name != name:
                self.drop_engine(key[0])
                return

    def drop_engine(self, engine_id: str) -> int:
        """Forget a remote engine (it died or restarted): plans, topology, peers."""
        for shape in [s for s in self.plans if s[0] == engine_id]:
            del self.plans[shape]
        for key in [k for k in self.confirms if k[0] == engine_id]:
            del self.confirms[key]
        self.topology.unregister_remote_engine(engine_id)
        return self.transport.remove_engine(engine_id)
