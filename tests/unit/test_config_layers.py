"""One config tree, typed to the edge (issue 26): serving/config.py is serving/'s ground floor, the
deployment's `transfer:` section is the engines' `EngineConfig.transfer` (one `TransferConfig`), and
it crosses vLLM whole inside `kv_connector_extra_config`, read back once into the same type."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.engine.config import EngineConfig
from actors.engine.vllm.extra_config import TRANSFER_KEY, ConnectorExtraConfig
from actors.transfer_config import TransferConfig
from serving.config import DeploymentConfig

ROOT = Path(__file__).resolve().parents[2]
# config types kept beside serving/config.py (it imports them; they import nothing else of serving/)
CONFIG_PARTS = {"serving.autoscaler_config", "serving.placement_config", "serving.router_config",
                "serving.runtime_config"}


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement of `path` names, wherever it stands (lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names.add(node.module or "")
    return names


def _serving_imports(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    return {m for m in _imported_modules(path) if m == "serving" or m.startswith("serving.")}


def test_serving_config_imports_nothing_above_it():
    assert _serving_imports("serving.config") <= CONFIG_PARTS
    for part in CONFIG_PARTS:  # a part imports at most the other parts of the floor
        assert _serving_imports(part) <= CONFIG_PARTS - {part}, part


def test_the_config_types_are_imported_downward():
    # the routing and cluster layers take their config types from the config floor, not the reverse
    from serving.autoscaler_config import AutoscalerConfig
    from serving.cluster import autoscale_policy
    from serving.placement_config import PlacementConfig
    from serving.routing import slo_model

    assert autoscale_policy.AutoscalerConfig is AutoscalerConfig
    assert slo_model.PlacementConfig is PlacementConfig
    assert DeploymentConfig.model_fields["autoscaler"].annotation is AutoscalerConfig


def test_engine_configs_embed_the_deployments_transfer_section():
    dep = DeploymentConfig.from_dict({"transfer": {"verify": "sample", "failure_policy": "recompute",
                                                   "lease_ttl_s": 12.5, "sync_load_max_tokens": 0}})
    assert type(dep.transfer) is TransferConfig
    for role in ("prefill", "decode"):
        ecfg = dep.engine_config(role)
        assert type(ecfg.transfer) is TransferConfig
        assert ecfg.transfer == dep.transfer
        assert ecfg.transfer.verify == "sample" and ecfg.transfer.failure_policy == "recompute"
        assert ecfg.transfer.lease_ttl_s == 12.5 and ecfg.transfer.sync_load_max_tokens == 0


def test_engine_config_has_no_copy_of_the_transfer_fields():
    copies = {"kv_verify", "kv_load_failure_policy", *TransferConfig.model_fields} & set(EngineConfig.model_fields)
    assert copies == set()
    with pytest.raises(ValidationError):
        EngineConfig(role="decode", lease_ttl_s=5)  # a flat copy is refused, not silently ignored


def test_engine_config_transfer_survives_the_actor_boundary():
    # the engine actor receives cfg.model_dump() and validates it again
    cfg = EngineConfig(role="decode", backend="synthetic", transfer=TransferConfig(verify="all", fault_rate=0.25))
    again = EngineConfig.model_validate(cfg.model_dump())
    assert again.transfer == cfg.transfer and type(again.transfer) is TransferConfig


def test_extra_config_round_trips_a_transfer_config():
    transfer = TransferConfig(failure_policy="recompute", lease_ttl_s=7.0, read_timeout_s=3.0,
                              sync_load_max_tokens=64, fault_rate=0.1, verify="sample")
    extra = ConnectorExtraConfig(engine_id="D", handshake_dir="/tmp/hs", model_id="m", incarnation="abc",
                                 transfer=transfer).to_extra_config()
    assert extra[TRANSFER_KEY] == transfer.model_dump()  # the whole section under one key, plain values
    assert not set(TransferConfig.model_fields) & set(extra)  # no field of it loose beside the others
    parsed = ConnectorExtraConfig.from_extra_config(extra)
    assert parsed.transfer == transfer and type(parsed.transfer) is TransferConfig
    assert (parsed.engine_id, parsed.handshake_dir, parsed.model_id, parsed.incarnation) == ("D", "/tmp/hs", "m", "abc")


def test_extra_config_defaults_come_from_the_type_and_bad_values_are_refused():
    assert ConnectorExtraConfig.from_extra_config(None).transfer == TransferConfig()
    # keys of vLLM's or an operator's own beside ours are left alone
    assert ConnectorExtraConfig.from_extra_config({"backends": ["UCX"]}).engine_id is None
    with pytest.raises(ValidationError):
        ConnectorExtraConfig.from_extra_config({TRANSFER_KEY: {"verify": "sometimes"}})
    with pytest.raises(ValidationError):
        ConnectorExtraConfig.from_extra_config({TRANSFER_KEY: {"lease_ttl": 3.0}})  # a typo is refused


def test_connector_halves_get_the_engines_transfer_config(tmp_path):
    """The real path at the vLLM edge: EngineConfig -> kv_transfer_config (vLLM's own class) ->
    RayNixlConnector, scheduler half and worker half (no engine is started)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from actors.engine.vllm.args import pd_kv_transfer
    from actors.engine.vllm.connector import RayNixlConnector

    transfer = TransferConfig(lease_ttl_s=9.0, read_timeout_s=4.0, sync_load_max_tokens=128, fault_rate=0.5,
                              verify="all", failure_policy="recompute")
    cfg = EngineConfig(role="decode", transfer=transfer)
    extra = ConnectorExtraConfig(engine_id="eng-D", handshake_dir=str(tmp_path), transfer=cfg.transfer)
    kv = KVTransferConfig(**pd_kv_transfer(cfg, "eng-D", extra.to_extra_config()))
    assert kv.kv_load_failure_policy == "recompute"
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, prefill_context_parallel_size=1),
        model_config=SimpleNamespace(use_mla=False), cache_config=SimpleNamespace(block_size=16))
    scheduler = RayNixlConnector(vllm_config, KVConnectorRole.SCHEDULER)._scheduler
    assert (scheduler.engine_id, scheduler.lease_ttl_s, scheduler.sync_load_max_tokens) == ("eng-D", 9.0, 128)
    worker = RayNixlConnector(vllm_config, KVConnectorRole.WORKER)._worker
    assert worker.transfer == transfer and worker.settings.handshake_dir == str(tmp_path)
    assert worker.faults.rate == 0.5
