"""The Serve builder without a cluster: config resolution, the shipped Serve config file, the bound app."""

from pathlib import Path

import pytest
import yaml

from serving.cluster.app import build_app, resolve_config
from serving.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_resolve_config_from_a_file_with_overrides():
    cfg = resolve_config({"config_path": "configs/synthetic.yaml", "name": "x", "http.port": "8123",
                          "decode": {"count": 2}})
    assert (cfg.name, cfg.http.port, cfg.decode.count, cfg.decode.tp_size, cfg.backend) == (
        "x", 8123, 2, 4, "synthetic")
    assert cfg.prefill.count == 2  # untouched fields come from the file
    assert resolve_config({"backend": "synthetic"}).backend == "synthetic"
    assert resolve_config({"config": str(ROOT / "configs/local.yaml")}).model == "smollm2"


def test_bad_configs_are_refused_before_anything_deploys():
    with pytest.raises(ConfigError, match="decode"):
        build_app({"decode": {"count": 0}})
    with pytest.raises(ConfigError, match="not found"):
        build_app({"config_path": "configs/missing.yaml"})


def test_shipped_serve_config_file_is_valid_and_builds():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((ROOT / "configs/serve-synthetic.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(data)
    app_cfg = schema.applications[0]
    assert app_cfg.import_path == "serving.cluster.app:build_app"
    app = build_app(app_cfg.args)
    ingress = app._bound_deployment
    assert ingress.name == "RaypdIngress" and ingress.num_replicas == 1
    bound_cfg = app._bound_deployment.init_args[0]
    assert bound_cfg["backend"] == "synthetic" and bound_cfg["prefill"]["tp_size"] == 2


def test_engine_kwargs_vllm_refuses_fail_the_build_naming_the_key():
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match=r"both\.engine_kwargs\.max_num_seqz"):
        build_app({"config_path": "configs/local.yaml", "both": {"engine_kwargs": {"max_num_seqz": 4}}})
