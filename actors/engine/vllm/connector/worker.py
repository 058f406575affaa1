"""Worker side of RayNixlConnector: one per vLLM worker (rank), in its process.

A thin adapter of vLLM's per-step hooks to `RankTransfer`, the same object the synthetic engine
drives: the rank's caches become a `CacheGeometry` registered with NIXL, its handshake payload goes
to the engine's handshake folder (no Ray client in vLLM processes), and each step's metadata holds
leases, starts and abandons pulls and frees released leases. Invariants: a sync load is waited for
before the step's forward and never reported finished or failed (vLLM asserts), a failed one's
blocks go to `invalid_block_ids`; peers' READs of this rank never wait for its steps (NIXL's
progress thread serves them). The hooks one by one: `ConnectorWorker`.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from actors.engine.vllm.connector.metadata import LeaseEnds, RayNixlMetadata, RecvSpec
from actors.engine.vllm.extra_config import ConnectorExtraConfig
from actors.kv.transfer_errors import HandshakeError, LayoutError, TopologyError
from actors.kv.faults import FaultPolicy
from actors.kv.handshake import CompatInfo, decode_envelope
from actors.kv.plan.layout import CPU_HKND, MLA_ND, NHD, CacheGeometry
from actors.kv.plan.pull_types import StepResult
from actors.kv.rank_transfer import RankIdentity, RankTransfer
from actors.kv.nixl.nixl_transport import NixlTransport
from actors.kv.transport import PeerKey
from actors.transfer_params import TransferParams

logger = logging.getLogger("raypd.connector")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def handshake_file(folder: str | Path, pp_rank: int, tp_rank: int) -> Path:
    return Path(folder) / f"pp{pp_rank}-tp{tp_rank}.handshake"


def check_supported(vllm_config: Any) -> int:
    """The decode context parallel size vLLM runs with, or a TopologyError naming what
    raypd cannot map (called when the connector is created, before any request)."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    tp = pc.tensor_parallel_size
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    interleave = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1)
    use_mla = bool(getattr(mc, "use_mla", False))
    problems = []
    if pcp > 1:
        problems.append(f"prefill_context_parallel_size={pcp} (raypd supports 1)")
    if dcp not in (1, tp):
        problems.append(f"decode_context_parallel_size={dcp} with tensor_parallel_size={tp} "
                        "(raypd supports dcp 1 or dcp == tp)")
    if dcp > 1 and not use_mla:
        problems.append(f"decode_context_parallel_size={dcp} without MLA (raypd shards MLA caches only)")
    if dcp > 1 and interleave != 1:
        problems.append(f"cp_kv_cache_interleave_size={interleave} with decode_context_parallel_size={dcp} "
                        "(raypd expects token t on dcp rank t % dcp)")
    if problems:
        raise TopologyError("RayNixlConnector cannot serve this configuration: " + "; ".join(problems))
    return dcp


def geometry_from_vllm(kv_caches: dict[str, torch.Tensor], block_size: int, use_mla: bool = False
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
    if use_mla:
        # one latent row per token (kv_lora_rank + rope dims); vLLM's CPU MLA backend keeps a
        # singleton head axis: [blocks, 1, block_size, latent]
        shape = tuple(first.shape)
        if not (len(shape) == 3 and shape[1] == block_size) and not (len(shape) == 4 and shape[1:3] == (1, block_size)):
            raise LayoutError(f"unsupported MLA KV cache shape {shape} (block size {block_size}); raypd expects "
                              "[blocks, block_size, latent] or [blocks, 1, block_size, latent]")
        nb, head_size = shape[0], shape[-1]
        heads, layout = 1, MLA_ND
        planes = [[kv_caches[n].view(nb, block_size, head_size)] for n in names]
    elif first.dim() == 4 and first.shape[2] == block_size and first.shape[3] % 2 == 0:
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
            "supports vLLM's CPU layout, flash-attention K/V planes and MLA latent caches"
        )
    geometry = CacheGeometry.from_tensors(planes, layout, block_size, heads, head_size, first_layer=indices[0])
    return geometry, planes


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def merge_steps(steps: list[StepResult]) -> StepResult:
    """Several `RankTransfer.step()` results as one (dicts united, sequences concatenated)."""
    if len(steps) == 1:
        return steps[0]
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(StepResult):
        values = [getattr(s, f.name) for s in steps]
        if isinstance(values[0], dict):
            merged[f.name] = {k: v for d in values for k, v in d.items()}
        elif isinstance(values[0], (set, frozenset)):
            merged[f.name] = type(values[0])().union(*values)
        else:
            merged[f.name] = type(values[0])(x for v in values for x in v)
    return StepResult(**merged)


class ParamsDirectory:
    """Handshake payloads of one request, as the decode EngineActor attached them."""

    def __init__(self, params: TransferParams):
        self._by_key: dict[PeerKey, bytes] = {}
        self.agents: dict[PeerKey, str] = {}  # which agent answers for each rank (restart check)
        for text in params.handshakes:
            try:
                data = base64.b64decode(text, validate=True)
                body = decode_envelope(data)[2]
                key = (body["engine_id"], int(body["pp_rank"]), int(body["tp_rank"]))
                self._by_key[key] = data
                self.agents[key] = str(body["agent_name"])
            except (ValueError, KeyError, TypeError) as exc:
                raise HandshakeError("handshakes", f"a payload in kv_transfer_params is malformed: {exc}") from None

    def __call__(self, engine_id: str, pp_rank: int, ranks: list[int]) -> list[bytes]:
        missing = [r for r in ranks if (engine_id, pp_rank, r) not in self._by_key]
        if missing:
            raise HandshakeError("handshakes", f"no payload for {engine_id} pp {pp_rank} ranks {missing}")
        return [self._by_key[(engine_id, pp_rank, r)] for r in ranks]


class ConnectorWorker:
    """vLLM's per-step hooks, one by one:

      register_kv_caches   vLLM's cache tensors -> CacheGeometry (vLLM's CPU layout
                           is (H, K/V, N, D) per block; flash-attention caches are
                           split K and V planes in NHD; MLA caches are one latent
                           row per token) -> NIXL registration; TP/PP/DCP sizes and
                           MLA come from vLLM's parallel and model config
                           (`check_supported` refused what raypd cannot map); the
                           rank's handshake payload is written to the engine's
                           handshake folder, where the EngineActor collects it for
                           the coordinator (no Ray client in vLLM processes);
      start_load_kv        metadata of this step: hold sent blocks under leases,
                           start the pulls of new loads (`TransferParams.pull_request`),
                           notify producers of abandoned loads, free the leases of
                           the release list (prefills nobody will read); sync loads
                           (vLLM calls this before the step's forward then) are
                           waited for here, stepping `RankTransfer` until each one
                           is done or failed (its own read timeout bounds it): a
                           failed one's blocks go to `invalid_block_ids`, and a sync
                           load is never reported finished or failed (vLLM asserts);
      get_transfer_results one `RankTransfer.step()` (plus what the sync wait
                           stepped): finished and failed pulls,
                           released and expired leases. Peers' READs of this
                           rank's KV do not wait for it: NIXL's progress thread
                           (asleep on UCX's fd, `actors.kv.nixl.nixl_binding`) serves
                           them while this process computes a step;
      worker_meta          what the step says of how leases ended besides the
                           readers' notices (`LeaseEnds`: expired, dropped for the
                           release list) and of the pulls that failed (with
                           `RankTransfer`'s reason: sync loads too), for the
                           scheduler half, which tells the EngineActor (vLLM's
                           `build_connector_worker_meta`).
    """

    def __init__(self, vllm_config: Any, engine_id: str, settings: ConnectorExtraConfig):
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.settings = settings
        self.transfer = settings.transfer
        self.dcp_size = check_supported(vllm_config)
        self.xfer: RankTransfer | None = None
        self._load_errors: set[int] = set()
        self._stepped: list[StepResult] = []  # what a sync wait stepped, reported by the next results
        self._sync_ids: set[str] = set()  # sync loads: never reported finished or failed
        self._expired: set[str] = set()  # leases that ended without their readers, until `worker_meta`
        self._dropped: set[str] = set()  # leases freed for the release list, likewise
        self._failed: dict[str, str] = {}  # pulls that failed (request -> why), likewise
        # test knob (transfer.fault_rate): this fraction of pulls fails on purpose
        self.faults = FaultPolicy(rate=self.transfer.fault_rate, seed=settings.fault_seed)

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
            pp_rank=pp.rank_in_group, pp_size=pp.world_size, dcp_size=self.dcp_size,
            block_size=self.vllm_config.cache_config.block_size,
        )

    @property
    def use_mla(self) -> bool:
        return bool(getattr(self.vllm_config.model_config, "use_mla", False))

    def _compat(self, geometry: CacheGeometry) -> CompatInfo:
        mc = self.vllm_config.model_config
        dtype = str(mc.dtype).replace("torch.", "")
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        packing = "mla" if self.use_mla else "packed" if "KV" in geometry.layout.axes else "split"
        return CompatInfo(
            model_id=self.settings.model_id or Path(str(mc.model)).name,
            dtype=dtype, num_kv_heads=mc.get_total_num_kv_heads(),
            num_layers=mc.get_total_num_hidden_layers() if hasattr(mc, "get_total_num_hidden_layers")
            else mc.hf_config.num_hidden_layers,
            head_size=mc.get_head_size(), cache_dtype=dtype if cache_dtype == "auto" else str(cache_dtype),
            kv_packing=packing, is_mla=self.use_mla,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        identity = self._identity()
        geometry, planes = geometry_from_vllm(kv_caches, identity.block_size, self.use_mla)
        # every rank of one engine incarnation shares the suffix (transfer params name it)
        incarnation = self.settings.incarnation or uuid.uuid4().hex[:8]
        name = f"{self.engine_id}-pp{identity.pp_rank}-tp{identity.tp_rank}-{incarnation}"
        mem = "VRAM" if next(iter(kv_caches.values())).is_cuda else "DRAM"
        transport = NixlTransport(name, geometry, read_timeout_s=self.transfer.read_timeout_s, mem=mem,
                                  min_link_mbps=self.transfer.min_link_mbps)
        self.xfer = RankTransfer(identity, geometry, planes, self._compat(geometry), transport,
                                 is_mla=self.use_mla, faults=self.faults, verify=self.transfer.verify)
        folder = self.settings.handshake_dir
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
            self.xfer.hold(req_id, send.block_ids, send.ttl_s)
        for req_id in meta.release:  # unread prefills: freed now, reported sent by this step's results
            if self.xfer.release(req_id):  # nothing when the lease had already ended (read or expired)
                self._dropped.add(req_id)
        for req_id, recv in meta.recv.items():
            self._start(req_id, recv)
        sync = {req_id: recv.local_block_ids for req_id, recv in meta.recv.items() if recv.sync}
        if sync:
            self._wait_sync(sync)
        for req_id, params in meta.abandon.items():
            try:
                directory = ParamsDirectory(params)
            except HandshakeError as exc:
                logger.info("abandoning %s: %s", req_id, exc)
                continue
            self.xfer.abandon(req_id, params.pull_request(()), directory)

    def _start(self, req_id: str, recv: RecvSpec) -> None:
        req = recv.params.pull_request(recv.local_block_ids, recv.remote_block_ids, recv.num_tokens)
        try:
            directory = ParamsDirectory(recv.params)
        except HandshakeError as exc:
            error = exc

            def directory(*_: Any) -> list[bytes]:  # the pull fails and is reported like any other
                raise error
        else:
            self.xfer.refresh_peers(directory.agents)  # a restarted producer answers under new agents
        self.xfer.start_pull(req_id, req, directory)

    def _wait_sync(self, req_ids: dict[str, tuple[int, ...]]) -> None:
        """Step until every sync load of this step is done or failed (vLLM computes on its blocks
        right after). The whole engine waits meanwhile, so a load not done within `sync_wait_s` (a
        partitioned or slow link) is failed like any pull: its producers are told (their leases end at
        once), its blocks are invalid and the failure policy applies."""
        self._sync_ids |= set(req_ids)
        pending = set(req_ids)
        deadline = time.monotonic() + self.transfer.sync_wait_s
        while pending:
            step = self.xfer.step()
            self._stepped.append(step)
            pending -= set(step.done) | set(step.failed)
            if pending and time.monotonic() > deadline:
                logger.warning("raypd: sync KV loads %s not done within %.1f s: failed", sorted(pending),
                               self.transfer.sync_wait_s)
                for req_id in pending:
                    self.xfer.fail_pull(req_id, f"sync load not done within {self.transfer.sync_wait_s:.1f} s")
                deadline = float("inf")  # the next step reports them failed (and sends the notices)
                continue
            if pending:
                time.sleep(0.0002)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last step."""
        if self.xfer is None:
            return set(), set(), set()
        step = merge_steps([*self._stepped, self.xfer.step()])
        self._stepped = []
        for req_id, reason in step.failed.items():
            logger.warning("raypd: KV pull of %s failed: %s", req_id, reason)
            self._load_errors.update(step.invalid_block_ids.get(req_id, ()))
            self._failed[req_id] = reason
        if step.expired:
            logger.warning("raypd: leases expired without readers: %s", list(step.expired))
            self._expired.update(step.expired)
        sync = self._sync_ids & step.finished_recving
        self._sync_ids -= sync  # each pull ends once
        return step.finished_sending, step.finished_recving - sync, set(step.failed) - sync

    def worker_meta(self) -> LeaseEnds | None:
        """The leases this rank let expire or dropped and the pulls that failed since the last call
        (None: every lease ended by notices, no pull failed)."""
        if not (self._expired or self._dropped or self._failed):
            return None
        ends = LeaseEnds(frozenset(self._expired), frozenset(self._dropped), tuple(self._failed.items()))
        self._expired, self._dropped, self._failed = set(), set(), {}
        return ends

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.xfer is not None:
            self.xfer.shutdown()
