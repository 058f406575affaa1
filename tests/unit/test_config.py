"""Deployment config: the shipped files load; bad input is refused naming the field."""

from pathlib import Path

import pytest

from serving.config import ConfigError, DeploymentConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["local.yaml", "synthetic.yaml", "gpu-example.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.decode.count >= 1
    assert cfg.engine_config("decode").role == "decode"


def test_local_default_is_smollm2_one_prefill_one_decode_on_loopback():
    cfg = load_config(CONFIGS / "local.yaml")
    assert (cfg.backend, cfg.model, cfg.prefill.count, cfg.decode.count) == ("vllm", "smollm2", 1, 1)
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 8000)
    assert cfg.engine_config("prefill").cpu_bind == "0"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"decode": {"count": 0}}, "at least one decode engine"),
        ({"prefill": {"tp_size": 3}, "decode": {"tp_size": 2}}, "must divide one another"),
        ({"prefill": {"block_size": 48}, "decode": {"block_size": 32}}, "must divide decode block_size"),
        ({"backend": "synthetic", "decode": {"tp_size": 3}}, "num_kv_heads"),
        ({"backend": "synthetic", "decode": {"tp_size": 2, "dcp_size": 2}}, "MLA"),
        ({"decode": {"tp_size": 2, "dcp_size": 2}}, "synthetic backend"),
        ({"prefill": {"count": 2, "cpu_bind": ["0"]}}, "one entry per engine"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"bogus": 1}, "bogus"),
        ({"transfer": {"failure_policy": "maybe"}}, "transfer.failure_policy"),
        ({"prefill": {"count": 0}, "router": {"no_prefill_fallback": "reject"}}, "nothing could be served"),
    ],
)
def test_invalid_configs_are_refused_with_a_clear_reason(data, message):
    with pytest.raises(ConfigError, match=message):
        DeploymentConfig.from_dict(data)


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)
