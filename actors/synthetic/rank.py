"""One rank of a synthetic engine: a real KV cache, a transport, leases, pulls.

Life cycle of a request across ranks:

  prefill rank  write_prompt(req)   values of its heads/layers/token shard are
                                    written into the blocks, which are then
                                    held under a lease;
  decode rank   start_pull(req)     handshakes (through the directory) with the
                                    prefill ranks it needs, once per engine,
                                    posts the READs of its read plan; each READ
                                    carries a notification for its source;
                poll()              finished pulls are transformed into the
                                    local layout, verified element by element
                                    and summarized as per-position checksums;
                                    replicas that were skipped are notified;
                                    a failed pull notifies every source too,
                                    so nothing waits for the lease to expire;
  prefill rank  poll()              notifications release leases; expired
                                    leases are released too.

This class has no Ray import: `actors.synthetic.engine` runs it as an actor,
unit tests drive it in-process with `FakeTransport`.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from actors.kv.errors import HandshakeError, KVTransferError
from actors.kv.handshake import CompatInfo, RankHandshake, decode_handshake
from actors.kv.layout import (
    BlockLayout,
    CacheGeometry,
    canonical_view,
    compatible_geometry,
    block_read_runs,
    to_local_layout,
    token_read_runs,
)
from actors.kv.lease import LeaseTable
from actors.kv.topology import (
    EngineTransferInfo,
    TransferTopology,
    pp_layer_range,
    rank_global_heads,
)
from actors.kv.transport import NixlTransport, PeerKey
from actors.synthetic.pattern import kv_values

logger = logging.getLogger("raypd.synthetic")

NOTIF_PREFIX = b"raypd1|"


@dataclass(frozen=True)
class SyntheticModel:
    """The 'model' a synthetic engine pretends to run: only KV shapes matter."""

    model_id: str = "synthetic-tiny"
    num_layers: int = 4
    num_kv_heads: int = 4  # 1 for MLA
    head_size: int = 32
    is_mla: bool = False
    vocab_size: int = 32000
    dtype: str = "float32"


@dataclass(frozen=True)
class RankConfig:
    engine_id: str
    role: str
    model: SyntheticModel
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp_size: int = 1
    block_size: int = 16
    num_blocks: int = 64
    layout: str = "HND"  # HND | NHD | HCND (K/V packed, vLLM CPU) | ND (MLA)
    read_timeout_s: float = 30.0

    @property
    def kv_packing(self) -> str:
        if self.model.is_mla:
            return "mla"
        return "packed" if "C" in self.layout.upper() else "split"

    def compat(self) -> CompatInfo:
        m = self.model
        return CompatInfo(
            model_id=m.model_id, dtype=m.dtype, num_kv_heads=m.num_kv_heads, num_layers=m.num_layers,
            head_size=m.head_size, cache_dtype=m.dtype, kv_packing=self.kv_packing, is_mla=m.is_mla,
        )


@dataclass
class _Pull:
    token_ids: list[int]
    seed: int
    block_ids: list[int]
    remote_layout: BlockLayout | None = None
    ratio: int = 1
    block_mode_layers: set[int] = field(default_factory=set)
    notify: list[tuple[PeerKey, bytes]] = field(default_factory=list)


def encode_notif(req_id: str, reader: str, consumers: int, ok: bool) -> bytes:
    return NOTIF_PREFIX + json.dumps({"req": req_id, "reader": reader, "n": consumers, "ok": ok}).encode()


def decode_notif(msg: bytes) -> dict | None:
    if not msg.startswith(NOTIF_PREFIX):
        return None
    try:
        data = json.loads(msg[len(NOTIF_PREFIX):])
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("req"), str):
        return None
    return data


HandshakeDirectory = Callable[[str, int, list[int]], list[bytes]]


class SyntheticRank:
    def __init__(self, cfg: RankConfig, directory: HandshakeDirectory | None = None,
                 transport_factory: Callable[[str, CacheGeometry], object] | None = None):
        self.cfg = cfg
        m = cfg.model
        self.layout = BlockLayout.parse(cfg.layout)
        self.first_layer, self.end_layer = pp_layer_range(m.num_layers, cfg.pp_size, cfg.pp_rank)
        self.g0, self.g1 = rank_global_heads(cfg.tp_rank, cfg.tp_size, m.num_kv_heads, m.is_mla)
        self.num_heads = self.g1 - self.g0
        planes = 2 if cfg.kv_packing == "split" else 1
        dims = {"KV": 2, "H": self.num_heads, "N": cfg.block_size, "D": m.head_size}
        shape = (cfg.num_blocks, *(dims[a] for a in self.layout.axes))
        self.tensors = [
            [torch.zeros(shape, dtype=torch.float32) for _ in range(planes)]
            for _ in range(self.end_layer - self.first_layer)
        ]
        self.geometry = CacheGeometry.from_tensors(
            self.tensors, self.layout, cfg.block_size, self.num_heads, m.head_size,
            first_layer=self.first_layer,
        )
        self.compat = cfg.compat()
        self.topology = TransferTopology(
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, block_size=cfg.block_size,
            engine_id=cfg.engine_id, is_mla=m.is_mla, is_mamba=False,
            total_num_kv_heads=m.num_kv_heads, dcp_size=cfg.dcp_size,
        )
        self.agent_name = f"{cfg.engine_id}-pp{cfg.pp_rank}-tp{cfg.tp_rank}-{uuid.uuid4().hex[:8]}"
        factory = transport_factory or (
            lambda name, geo: NixlTransport(name, geo, read_timeout_s=cfg.read_timeout_s)
        )
        self.transport = factory(self.agent_name, self.geometry)
        self.directory = directory
        self.leases = LeaseTable()
        self.reader_name = f"{cfg.engine_id}:{cfg.pp_rank}:{cfg.tp_rank}"
        self._pulls: dict[str, _Pull] = {}

    # ------------------------------------------------------------ identity
    def handshake(self) -> bytes:
        cfg = self.cfg
        return RankHandshake(
            engine_id=cfg.engine_id, role=cfg.role, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank, pp_size=cfg.pp_size, dcp_size=cfg.dcp_size,
            block_size=cfg.block_size, agent_name=self.agent_name,
            agent_metadata=self.transport.metadata(), geometry=self.geometry, compat=self.compat,
        ).encode()

    # -------------------------------------------------------------- cache io
    def _kv_views(self, layer: int) -> list[torch.Tensor]:
        """[num_blocks, H, N, D] views of K and V (one latent view for MLA)."""
        planes = self.tensors[layer - self.first_layer]
        if self.cfg.kv_packing == "split":
            return [canonical_view(p, self.layout) for p in planes]
        view = canonical_view(planes[0], self.layout)
        if self.cfg.kv_packing == "packed":
            return [view[:, 0], view[:, 1]]
        return [view.unsqueeze(1)]

    def _my_positions(self, num_tokens: int) -> list[int]:
        d, r = self.cfg.dcp_size, self.topology.dcp_rank
        return [t for t in range(num_tokens) if t % d == r]

    def _block_chunks(self, block_ids: list[int], count: int):
        bs = self.cfg.block_size
        for j in range(math.ceil(count / bs)):
            yield block_ids[j], j * bs, min(bs, count - j * bs)

    def _expected(self, token_ids: list[int], seed: int, positions: list[int], layer: int, kv: int):
        toks = torch.tensor([token_ids[t] for t in positions], dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        heads = torch.arange(self.g0, self.g1)
        return kv_values(seed, toks, pos, layer, heads, kv, self.cfg.model.head_size)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(len(self._my_positions(num_tokens)) / self.cfg.block_size)

    def write_prompt(self, req_id: str, token_ids: list[int], block_ids: list[int], seed: int,
                     lease_ttl_s: float | None = None) -> None:
        """Prefill: write this rank's share of the prompt's KV; hold it under a lease."""
        positions = self._my_positions(len(token_ids))
        if len(block_ids) < self.blocks_needed(len(token_ids)):
            raise KVTransferError(f"{req_id}: {len(block_ids)} blocks for {len(positions)} token slots")
        for layer in range(self.first_layer, self.end_layer):
            for kv, view in enumerate(self._kv_views(layer)):
                values = self._expected(token_ids, seed, positions, layer, kv)
                for blk, start, n in self._block_chunks(block_ids, len(positions)):
                    view[blk, :, :n, :] = values[:, start:start + n, :]
        if lease_ttl_s is not None:
            self.leases.grant(req_id, block_ids, readers=1, ttl_s=lease_ttl_s)

    def read_back(self, token_ids: list[int], block_ids: list[int], seed: int) -> tuple[int, dict[int, float]]:
        """(mismatched elements, per-position checksums) of what this rank's cache holds."""
        positions = self._my_positions(len(token_ids))
        mismatches, sums = 0, torch.zeros(len(positions), dtype=torch.float64)
        for layer in range(self.first_layer, self.end_layer):
            for kv, view in enumerate(self._kv_views(layer)):
                got = torch.cat(
                    [view[blk, :, :n, :] for blk, _, n in self._block_chunks(block_ids, len(positions))],
                    dim=1,
                ) if positions else torch.zeros(self.num_heads, 0, self.cfg.model.head_size)
                want = self._expected(token_ids, seed, positions, layer, kv)
                mismatches += int((got != want).sum())
                sums += got.to(torch.float64).sum(dim=(0, 2))
        return mismatches, {t: float(s) for t, s in zip(positions, sums)}

    # ------------------------------------------------------------- decode
    def _connect(self, engine_id: str, pp_rank: int, tp_size: int, dcp_size: int) -> None:
        """Handshake with the remote ranks this rank needs, once per (engine, pp rank)."""
        targets = self.topology.handshake_target_ranks(tp_size, dcp_size)
        if all(self.transport.has_peer((engine_id, pp_rank, r)) for r in targets):
            try:
                self.topology.get_engine_info(engine_id, pp_rank)
                return
            except KVTransferError:
                pass
        if self.directory is None:
            raise HandshakeError("directory", "this rank has no handshake directory")
        payloads = self.directory(engine_id, pp_rank, targets)
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

    def start_pull(self, req_id: str, params: dict, token_ids: list[int], block_ids: list[int], seed: int) -> None:
        """Post every READ this rank needs for a request prefilled elsewhere."""
        engine_id = params["remote_engine_id"]
        remote_ids = list(params["remote_block_ids"])
        pull = _Pull(token_ids=list(token_ids), seed=seed, block_ids=list(block_ids))
        self._pulls[req_id] = pull
        try:
            for pp_rank in range(params["pp_size"]):
                self._connect(engine_id, pp_rank, params["tp_size"], params["dcp_size"])
                plan = self.topology.read_plan(engine_id, pp_rank)
                read_ranks = set()
                for spec in plan.reads:
                    key = (engine_id, pp_rank, spec.remote_rank)
                    remote = self.transport.peer(key).geometry
                    if spec.token_shard is None:
                        runs = block_read_runs(spec, self.geometry, remote, block_ids, remote_ids)
                        pull.remote_layout, pull.ratio = remote.layout, spec.block_size_ratio
                        pull.block_mode_layers.update(
                            range(max(self.first_layer, remote.first_layer),
                                  min(self.end_layer, remote.first_layer + remote.num_layers)))
                    else:
                        runs = token_read_runs(spec, self.geometry, remote, block_ids, remote_ids, len(token_ids))
                    notif = encode_notif(req_id, self.reader_name, plan.consumers_per_remote_rank, True)
                    self.transport.start_read(req_id, key, runs, notif)
                    read_ranks.add(spec.remote_rank)
                for rank in plan.notify_ranks:
                    key = (engine_id, pp_rank, rank)
                    ok = encode_notif(req_id, self.reader_name, plan.consumers_per_remote_rank, True)
                    pull.notify.append((key, ok if rank not in read_ranks else b""))
        except KVTransferError as exc:
            self.transport.fail_request(req_id, f"{type(exc).__name__}: {exc}")

    def poll(self) -> dict:
        """Advance pulls and leases. Returns finished/failed pulls and released leases."""
        out: dict = {"finished": {}, "failed": {}, "released": [], "expired": []}
        if self._pulls:
            result = self.transport.poll()
            for req_id in result.done:
                pull = self._pulls.pop(req_id)
                self._to_local_layout(pull)
                mismatches, sums = self.read_back(pull.token_ids, pull.block_ids, pull.seed)
                out["finished"][req_id] = {"mismatches": mismatches, "checksums": sums}
                for key, msg in pull.notify:
                    if msg:
                        self._send_quietly(key, msg)
            for req_id, reason in result.failed.items():
                pull = self._pulls.pop(req_id, None)
                out["failed"][req_id] = {"reason": reason, "invalid_block_ids": pull.block_ids if pull else []}
                for key, _ in (pull.notify if pull else []):
                    self._send_quietly(key, encode_notif(req_id, self.reader_name, 1, False))
        if self.leases.held():
            for msg in self.transport.get_notifs():
                data = decode_notif(msg)
                if data is None:
                    continue
                n = data.get("n") if isinstance(data.get("n"), int) and data.get("n", 0) >= 1 else None
                if not data.get("ok", True):
                    released = self.leases.release(data["req"]) or None
                else:
                    released = self.leases.notify(data["req"], str(data.get("reader")), n)
                if released is not None:
                    out["released"].append(data["req"])
            out["expired"] = [req for req, _ in self.leases.expire()]
        return out

    def _send_quietly(self, key: PeerKey, msg: bytes) -> None:
        try:
            if self.transport.has_peer(key):
                self.transport.send_notif(key, msg)
        except KVTransferError as exc:  # the producer may be gone; its lease will expire
            logger.warning("notifying %s: %s", key, exc)

    def _to_local_layout(self, pull: _Pull) -> None:
        if pull.remote_layout is None or not pull.block_mode_layers:
            return
        n_blocks = math.ceil(len(self._my_positions(len(pull.token_ids))) / self.cfg.block_size)
        for layer in sorted(pull.block_mode_layers):
            for plane in self.tensors[layer - self.first_layer]:
                to_local_layout(plane, pull.block_ids[:n_blocks], pull.remote_layout, self.layout, pull.ratio)

    # ---------------------------------------------------------- lifecycle
    def abort(self, req_id: str) -> bool:
        """Drop a request on this rank: cancel its pull and release its lease."""
        had_pull = self._pulls.pop(req_id, None) is not None
        self.transport.cancel(req_id)
        return bool(self.leases.release(req_id)) or had_pull

    def drop_engine(self, engine_id: str) -> int:
        """Forget a remote engine (it died or left): its agents and topology entries."""
        self.topology.unregister_remote_engine(engine_id)
        return self.transport.remove_engine(engine_id)

    def stats(self) -> dict:
        s = self.transport.stats
        return {
            "agent": self.agent_name,
            "leases": self.leases.counters(),
            "pulls_in_flight": len(self._pulls),
            "transport_in_flight": self.transport.in_flight(),
            "peers": len(self.transport.peers()),
            "reads_posted": s.reads_posted,
            "descriptors_posted": s.descriptors_posted,
            "bytes_posted": s.bytes_posted,
            "registered_regions": getattr(self.transport, "registered_regions", None),
        }

    def shutdown(self) -> dict:
        self.transport.shutdown()
        return self.stats()
