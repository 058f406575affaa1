"""RayNixlConnector: the KVConnectorBase_V1 face of raypd's KV transfer.

vLLM builds one instance with role SCHEDULER (EngineCore process) and one with role WORKER per rank;
each delegates to its half (`ConnectorScheduler`, `ConnectorWorker`). Invariants: both refuse, when
created, a parallel/model configuration raypd cannot map (`check_supported` names it);
`kv_connector_extra_config` is validated once, here, into a typed `ConnectorExtraConfig`; how a
lease ended and why a pull failed reach the EngineActor only through what vLLM already carries
(worker metadata, connector stats). The path those take: `RayNixlConnector`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from actors.engine.vllm.connector.metadata import LeaseEndStats, RankHandshakeMetadata, RayNixlMetadata
from actors.engine.vllm.connector.scheduler import ConnectorScheduler
from actors.engine.vllm.connector.worker import ConnectorWorker, check_supported
from actors.engine.vllm.extra_config import ConnectorExtraConfig
from actors.engine.vllm.leases import PULL_FAILED, PullFailures
from actors.kv.plan.pull_types import failure_kind


class PullFailureMetrics(KVConnectorPromMetrics):
    """`vllm:raypd_kv_pull_failures{reason}`: a decode engine's failed pulls by kind
    (`actors.kv.plan.pull_types.failure_kind`; lease_ended: the producer's lease board refused the read)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(name="vllm:raypd_kv_pull_failures", labelnames=[*labelnames, "reason"],
                                    documentation="KV pulls that failed, by why (raypd's connector)")
        self._by = {(idx, kind): counter.labels(*values, kind)
                    for idx, values in per_engine_labelvalues.items() for kind in PullFailures.KINDS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for _req_id, reason in transfer_stats_data.get(PULL_FAILED) or ():
            child = self._by.get((engine_idx, failure_kind(str(reason))))
            if child is not None:  # (raising here would end vLLM's output handler)
                child.inc()


class RayNixlConnector(KVConnectorBase_V1):
    """How a lease ended reaches the EngineActor through what vLLM already carries:
    each worker's `build_connector_worker_meta` (leases expired or released in its
    step) goes to the scheduler half with the step's finished_sending; the
    scheduler half's `get_kv_connector_stats` (leases finished on every rank, by
    how) goes to the client with the step's scheduler stats
    (`actors.engine.vllm.leases`). `build_kv_connector_stats` lets vLLM's own
    logging stat logger read the same payload; `build_prom_metrics` exports its
    failed pulls by kind (`vllm:raypd_kv_pull_failures{reason}`; through Ray's
    metrics agent, tagged with the engine: `actors.engine.vllm.metrics`).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorExtraConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        engine_id = str(settings.engine_id or self._kv_transfer_config.engine_id)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            pc = vllm_config.parallel_config
            self._scheduler = ConnectorScheduler(
                engine_id=engine_id, tp_size=pc.tensor_parallel_size, pp_size=pc.pipeline_parallel_size,
                dcp_size=check_supported(vllm_config),  # refuses what raypd cannot map, by name
                block_size=vllm_config.cache_config.block_size,
                lease_ttl_s=settings.transfer.lease_ttl_s,
                sync_load_max_tokens=settings.transfer.sync_load_max_tokens,
            )
        else:
            self._worker = ConnectorWorker(vllm_config, engine_id, settings)

    # ----------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, RayNixlMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # async loads: the request runs once its KV is complete; sync: start_load_kv waited

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # pull model: the decode side reads; nothing to push

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        payload = self._worker.handshake() if self._worker else None
        return RankHandshakeMetadata(payload) if payload else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def get_kv_connector_stats(self) -> LeaseEndStats | None:
        return self._scheduler.lease_ends() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LeaseEndStats:
        return LeaseEndStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PullFailureMetrics:
        return PullFailureMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # heterogeneous layouts are permuted on receive
