"""Worker side of RayNixlConnector: one per vLLM worker (rank), in its process.

It adapts vLLM's per-step hooks to `RankTransfer`, the same object the
synthetic engine drives:

  register_kv_caches   vLLM's cache tensors -> CacheGeometry (vLLM's CPU layout
                       is (H, K/V, N, D) per block; flash-attention caches are
                       split K and V planes in NHD) -> NIXL registration; the
                       rank's handshake payload is written to the engine's
                       handshake folder, where the EngineActor collects it
                       for the coordinator (no Ray client in vLLM processes);
  start_load_kv        metadata of this step: hold sent blocks under leases,
                       post the READs of new loads, notify producers of
                       abandoned loads;
  get_transfer_results poll pulls and leases (this is the only place the NIXL
                       agent progresses; no thread spins).
"""

from __future__ import annotations

import base64
import logging
import os
import random
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from actors.connector.metadata import RayNixlMetadata, RecvSpec
from actors.kv.errors import HandshakeError, LayoutError
from actors.kv.handshake import CompatInfo, decode_envelope
from actors.kv.layout import CPU_HKND, NHD, CacheGeometry
from actors.kv.rank_transfer import PullRequest, RankIdentity, RankTransfer
from actors.kv.transport import NixlTransport
from actors.transfer_params import TransferParams

logger = logging.getLogger("raypd.connector")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def handshake_file(folder: str | Path, pp_rank: int, tp_rank: int) -> Path:
    return Path(folder) / f"pp{pp_rank}-tp{tp_rank}.handshake"


def geometry_from_vllm(kv_caches: dict[str, torch.Tensor], block_size: int
                       ) -> tuple[CacheGeometry, list[list[torch.Tensor]]]:
    """Describe vLLM's per-layer cache tensors; returns the geometry and plane views."""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")

    def layer_of(name: str) -> int:
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
        return int(match.group(1))

    names = sorted(kv_caches, key=layer_of)
    indices = [layer_of(n) for n in names]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise LayoutError(f"KV cache layers are not consecutive: {indices}")
    first = kv_caches[names[0]]
    if first.dim() == 4 and first.shape[2] == block_size and first.shape[3] % 2 == 0:
        # vLLM CPU: [blocks, heads, block_size, 2*head], used as [blocks, heads, 2*block_size,
        # head]: per head, K of every slot, then V of every slot
        nb, heads, _, packed = first.shape
        head_size = packed // 2
        layout = CPU_HKND
        planes = [[kv_caches[n].view(nb, heads, 2, block_size, head_size)] for n in names]
    elif first.dim() == 5 and first.shape[0] == 2 and first.shape[2] == block_size:
        # flash attention: [2 (K, V), blocks, block_size, heads, head]
        _, nb, _, heads, head_size = first.shape
        layout = NHD
        planes = [[kv_caches[n][0], kv_caches[n][1]] for n in names]
    else:
        raise LayoutError(
            f"unsupported KV cache shape {tuple(first.shape)} (block size {block_size}); raypd "
            "supports vLLM's CPU layout and flash-attention K/V planes"
        )
    geometry = CacheGeometry.from_tensors(planes, layout, block_size, heads, head_size, first_layer=indices[0])
    return geometry, planes


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class ParamsDirectory:
    """Handshake payloads of one request, as the decode EngineActor attached them."""

    def __init__(self, params: TransferParams):
        self._by_key: dict[tuple[str, int, int], bytes] = {}
        for text in params.handshakes:
            try:
                data = base64.b64decode(text, validate=True)
                body = decode_envelope(data)[2]
                self._by_key[(body["engine_id"], int(body["pp_rank"]), int(body["tp_rank"]))] = data
            except (ValueError, KeyError, TypeError) as exc:
                raise HandshakeError("handshakes", f"a payload in kv_transfer_params is malformed: {exc}") from None

    def __call__(self, engine_id: str, pp_rank: int, ranks: list[int]) -> list[bytes]:
        missing = [r for r in ranks if (engine_id, pp_rank, r) not in self._by_key]
        if missing:
            raise HandshakeError("handshakes", f"no payload for {engine_id} pp {pp_rank} ranks {missing}")
        return [self._by_key[(engine_id, pp_rank, r)] for r in ranks]


class ConnectorWorker:
    def __init__(self, vllm_config: Any, engine_id: str, extra: dict):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.extra = extra
        self.xfer: RankTransfer | None = None
        self._load_errors: set[int] = set()
        self._early_release: set[str] = set()
        self.fault_rate = float(extra.get("fault_rate", 0.0))
        self._faults = random.Random(int(extra.get("fault_seed", 0)))

    def _identity(self) -> RankIdentity:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp = get_pp_group()
        role = self.vllm_config.kv_transfer_config.kv_role
        return RankIdentity(
            engine_id=self.engine_id, role={"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "both"),
            tp_rank=get_tensor_model_parallel_rank(), tp_size=get_tensor_model_parallel_world_size(),
            pp_rank=pp.rank_in_group, pp_size=pp.world_size, dcp_size=1,
            block_size=self.vllm_config.cache_config.block_size,
        )

    def _compat(self, geometry: CacheGeometry) -> CompatInfo:
        mc = self.vllm_config.model_config
        dtype = str(mc.dtype).replace("torch.", "")
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        return CompatInfo(
            model_id=str(self.extra.get("model_id") or Path(str(mc.model)).name),
            dtype=dtype, num_kv_heads=mc.get_total_num_kv_heads(),
            num_layers=mc.get_total_num_hidden_layers() if hasattr(mc, "get_total_num_hidden_layers")
            else mc.hf_config.num_hidden_layers,
            head_size=mc.get_head_size(), cache_dtype=dtype if cache_dtype == "auto" else str(cache_dtype),
            kv_packing="packed" if "KV" in geometry.layout.axes else "split", is_mla=bool(mc.use_mla),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        identity = self._identity()
        geometry, planes = geometry_from_vllm(kv_caches, identity.block_size)
        name = f"{self.engine_id}-pp{identity.pp_rank}-tp{identity.tp_rank}-{uuid.uuid4().hex[:8]}"
        mem = "VRAM" if next(iter(kv_caches.values())).is_cuda else "DRAM"
        transport = NixlTransport(name, geometry, read_timeout_s=float(self.extra.get("read_timeout_s", 10.0)),
                                  mem=mem)
        self.xfer = RankTransfer(identity, geometry, planes, self._compat(geometry), transport,
                                 is_mla=bool(self.vllm_config.model_config.use_mla))
        folder = self.extra.get("handshake_dir")
        if folder:
            _write_atomic(handshake_file(folder, identity.pp_rank, identity.tp_rank), self.xfer.handshake())
        logger.info("raypd worker %s registered %d KV regions (%s, %d blocks)", name,
                    len(geometry.regions()), geometry.layout.name, geometry.num_blocks)

    def handshake(self) -> bytes | None:
        return self.xfer.handshake() if self.xfer else None

    # ------------------------------------------------------------------ step
    def start_load_kv(self, meta: RayNixlMetadata) -> None:
        if self.xfer is None:
            return
        for req_id, send in meta.send.items():
            if self.xfer.hold(req_id, send.block_ids, send.ttl_s) is not None:
                self._early_release.add(req_id)
        for req_id, recv in meta.recv.items():
            self._start(req_id, recv)
        for req_id, params in meta.abandon.items():
            try:
                directory = ParamsDirectory(params)
            except HandshakeError as exc:
                logger.info("abandoning %s: %s", req_id, exc)
                continue
            self.xfer.abandon(req_id, self._pull_request(params, (), ()), directory)

    @staticmethod
    def _pull_request(params: TransferParams, local_ids, remote_ids, num_tokens: int = 0) -> PullRequest:
        return PullRequest(
            remote_engine_id=params.remote_engine_id, remote_block_ids=list(remote_ids),
            remote_tp_size=params.tp_size, remote_pp_size=params.pp_size, remote_dcp_size=params.dcp_size,
            local_block_ids=list(local_ids), num_tokens=num_tokens, remote_request_id=params.remote_request_id,
        )

    def _start(self, req_id: str, recv: RecvSpec) -> None:
        try:
            directory = ParamsDirectory(recv.params)
        except HandshakeError as exc:
            error = exc

            def directory(*_: Any) -> list[bytes]:  # the pull fails and is reported like any other
                raise error
        req = self._pull_request(recv.params, recv.local_block_ids, recv.remote_block_ids, recv.num_tokens)
        if recv.params.inject_fault or (self.fault_rate and self._faults.random() < self.fault_rate):
            self.xfer.fail_pull(req_id, req, "fault injected on purpose (test knob)")
            return
        self.xfer.start_pull(req_id, req, directory)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last step."""
        if self.xfer is None:
            return set(), set(), set()
        outcome = self.xfer.poll_pulls()
        failed = set(outcome.failed)
        for req_id, reason in outcome.failed.items():
            logger.warning("raypd: KV pull of %s failed: %s", req_id, reason)
            self._load_errors.update(outcome.invalid_block_ids.get(req_id, []))
        sending: set[str] = set(self._early_release)
        self._early_release.clear()
        if self.xfer.leases.held() or self.xfer.has_early_notices:
            released, expired = self.xfer.poll_leases()
            sending.update(released, expired)
            if expired:
                logger.warning("raypd: leases expired without readers: %s", expired)
        elif not self.xfer.pulls_in_flight:
            self.xfer.transport.progress()  # notices we sent may wait for a connection set-up
        return sending, set(outcome.done) | failed, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.xfer is not None:
            self.xfer.shutdown()
