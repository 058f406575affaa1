"""One rank of a synthetic engine: a real KV cache, a transport, leases, pulls.

A thin adapter: every transfer decision is `RankTransfer`'s. A prefill rank writes values of its
heads/layers/token shard into the blocks and leases them; a decode rank pulls, and verifies a
finished pull element by element, summarized as per-position checksums. Faults are injected by the
`FaultPolicy` the engine gives the rank. No Ray import: `actors.engine.synthetic.engine` runs it as
an actor, unit tests drive it in-process with `FakeTransport`. The life cycle of a request across
ranks: `SyntheticRank`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from actors.kv.transfer_errors import HandshakeError, KVTransferError
from actors.kv.faults import NO_FAULTS, FaultPolicy
from actors.kv.handshake import CompatInfo
from actors.kv.plan.layout import BlockLayout, CacheGeometry, canonical_view
from actors.kv.rank_transfer import HandshakeDirectory, RankIdentity, RankTransfer
from actors.kv.plan.topology import pp_layer_range, rank_global_heads
from actors.kv.nixl.nixl_transport import NixlTransport
from actors.engine.synthetic.pattern import kv_values
from actors.transfer_params import TransferParams

logger = logging.getLogger("raypd.synthetic")



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


@dataclass(frozen=True, kw_only=True)
class RankConfig(RankIdentity):
    """Who the rank is (`RankIdentity`) plus the cache it allocates."""

    model: SyntheticModel
    num_blocks: int = 64
    layout: str = "HND"  # HND | NHD | HCND (K/V packed, vLLM CPU) | ND (MLA)
    read_timeout_s: float = 30.0
    verify: str = "off"  # transfer.verify: off | sample | all (KV checksums, actors.kv.lease.integrity)

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


@dataclass(frozen=True)
class PulledKV:
    """A finished pull as this rank verified it."""

    mismatches: int
    checksums: dict[int, float]  # token position -> sum of what this rank holds for it


@dataclass(frozen=True)
class FailedPull:
    reason: str
    invalid_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RankPoll:
    """What one `SyntheticRank.poll()` produced."""

    finished: dict[str, PulledKV] = field(default_factory=dict)
    failed: dict[str, FailedPull] = field(default_factory=dict)
    released: tuple[str, ...] = ()
    expired: tuple[str, ...] = ()


class SyntheticRank:
    """Life cycle of a request across ranks:

      prefill rank  write_prompt(req)   values of its heads/layers/token shard are
                                        written into the blocks, which are then
                                        held under a lease;
      decode rank   start_pull(req)     `RankTransfer.start_pull` with the request
                                        built from its TransferParams: handshake
                                        once per engine (through the directory),
                                        then READs by descriptor index;
                    poll()              one `RankTransfer.step()`: finished pulls
                                        (already in the local layout) are verified
                                        element by element and summarized as
                                        per-position checksums; failed pulls carry
                                        their reason and invalid blocks;
      prefill rank  poll()              the same step releases leases (notices,
                                        expiry, aborts).

    A thin adapter: every transfer decision is `RankTransfer`'s. Faults are
    injected by the `FaultPolicy` the engine gives the rank. No Ray import:
    `actors.engine.synthetic.engine` runs it as an actor, unit tests drive it in-process
    with `FakeTransport`.
    """

    def __init__(self, cfg: RankConfig, directory: HandshakeDirectory | None = None,
                 transport_factory: Callable[[str, CacheGeometry], object] | None = None,
                 clock: Callable[[], float] = time.monotonic, faults: FaultPolicy = NO_FAULTS):
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
        self.agent_name = f"{cfg.engine_id}-pp{cfg.pp_rank}-tp{cfg.tp_rank}-{uuid.uuid4().hex[:8]}"
        factory = transport_factory or (
            lambda name, geo: NixlTransport(name, geo, read_timeout_s=cfg.read_timeout_s)
        )
        self.transport = factory(self.agent_name, self.geometry)
        self.directory = directory
        self.xfer = RankTransfer(cfg, self.geometry, self.tensors, self.compat, self.transport,
                                 is_mla=m.is_mla, faults=faults, clock=clock, verify=cfg.verify)
        self.topology = self.xfer.topology
        self.leases = self.xfer.leases
        self.reader_name = cfg.reader_name
        self._pulls: dict[str, tuple[list[int], int, list[int]]] = {}  # req -> (tokens, seed, blocks)

    # ------------------------------------------------------------ identity
    def handshake(self) -> bytes:
        return self.xfer.handshake()

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
            self.xfer.hold(req_id, block_ids, lease_ttl_s)

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
    def start_pull(self, req_id: str, params: TransferParams, token_ids: list[int], block_ids: list[int],
                   seed: int) -> None:
        """Post every READ this rank needs for a request prefilled elsewhere."""
        if self.directory is None:
            raise HandshakeError("directory", "this rank has no handshake directory")
        self._pulls[req_id] = (list(token_ids), seed, list(block_ids))
        self.xfer.start_pull(req_id, params.pull_request(block_ids, num_tokens=len(token_ids)), self.directory)

    def poll(self) -> RankPoll:
        """One transfer step: verified finished pulls, failed pulls, released leases."""
        step = self.xfer.step()
        finished: dict[str, PulledKV] = {}
        failed: dict[str, FailedPull] = {}
        for req_id in step.done:
            pulled = self._pulls.pop(req_id, None)
            if pulled is not None:
                tokens, seed, blocks = pulled
                finished[req_id] = PulledKV(*self.read_back(tokens, blocks, seed))
        for req_id, reason in step.failed.items():
            self._pulls.pop(req_id, None)
            failed[req_id] = FailedPull(reason, step.invalid_block_ids.get(req_id, ()))
        return RankPoll(finished, failed, step.released, step.expired)

    # ---------------------------------------------------------- lifecycle
    def abort(self, req_id: str) -> bool:
        """Drop a request on this rank: cancel its pull and release its lease."""
        had_pull = self._pulls.pop(req_id, None) is not None
        self.xfer.cancel(req_id)
        return bool(self.xfer.release(req_id)) or had_pull

    def drop_engine(self, engine_id: str) -> int:
        """Forget a remote engine (it died or left): its agents and topology entries."""
        return self.xfer.drop_engine(engine_id)

    def stats(self) -> dict:
        return self.xfer.stats()

    def shutdown(self) -> dict:
        return self.xfer.shutdown()
