"""engine_kwargs against vLLM's own argument classes, and what raypd adds for P/D (no engine is started)."""

import pytest

pytest.importorskip("vllm")

from actors.engine.vllm.args import (  # noqa: E402
    CONNECTOR,
    EngineArgsError,
    build_engine_args,
    check_engine_kwargs,
    pd_kv_transfer,
    pd_overrides,
)
from actors.engine.config import EngineConfig  # noqa: E402
from serving.config import ConfigError, DeploymentConfig, check_engine_args  # noqa: E402


@pytest.mark.parametrize(
    "kwargs, key, reason",
    [
        ({"max_num_seqz": 4}, "max_num_seqz", "did you mean max_num_seqs"),
        ({"max_num_seqs": "many"}, "max_num_seqs", "valid integer"),
        ({"enable_prefix_caching": "perhaps"}, "enable_prefix_caching", "valid boolean"),
        ({"kv_transfer_config": {"kv_rol": "kv_both"}}, "kv_transfer_config", "kv_rol"),
        ({"compilation_config": {"modez": 1}}, "compilation_config", "modez"),
    ],
)
def test_a_key_vllm_refuses_is_named(kwargs, key, reason):
    with pytest.raises(EngineArgsError, match=reason) as err:
        check_engine_kwargs(kwargs)
    assert err.value.key == key and str(err.value).startswith(f"{key}: ")


def test_the_error_survives_pickling():  # it travels from the engine actor to the launcher
    import pickle

    err = pickle.loads(pickle.dumps(EngineArgsError("max_num_seqz", "not a vLLM engine argument")))
    assert (err.key, str(err)) == ("max_num_seqz", "max_num_seqz: not a vLLM engine argument")


def test_valid_kwargs_pass():
    check_engine_kwargs({"max_num_seqs": 8, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5,
                         "compilation_config": {"mode": 0}, "trust_remote_code": True})


@pytest.fixture
def folder(tmp_path):
    """An existing model folder (with HF_HUB_OFFLINE set, vLLM looks a missing path up in the hub cache)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_engine_args_carry_engine_kwargs_and_pd_only_sets_the_connector(folder):
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        cfg = EngineConfig(role=role, model=folder, block_size=32, max_model_len=512,
                           engine_kwargs={"max_num_seqs": 5, "enable_prefix_caching": False,
                                          "kv_transfer_config": {"kv_buffer_device": "cpu"}})
        args = build_engine_args(cfg, folder, pd_kv_transfer(cfg, "e1", {"x": 1}))
        assert (args.model, args.tokenizer, args.max_num_seqs, args.enable_prefix_caching) == (folder, folder, 5, False)
        assert (args.block_size, args.max_model_len, args.dtype) == (32, 512, "auto")
        kv = args.kv_transfer_config
        assert (kv.kv_connector, kv.kv_role, kv.engine_id, kv.kv_buffer_device) == (CONNECTOR, kv_role, "e1", "cpu")
        assert args.disable_log_stats is False


def test_vllm_defaults_are_kept(folder):
    args = build_engine_args(EngineConfig(role="decode", model=folder), folder, None)
    assert args.enforce_eager is False and args.enable_prefix_caching is None  # None: vLLM turns it on
    assert args.kv_transfer_config is None and args.distributed_executor_backend is None


def test_overrides_are_announced():
    cfg = EngineConfig(role="prefill", engine_kwargs={
        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "disable_log_stats": True})
    notes = pd_overrides(cfg)
    assert len(notes) == 3
    assert "kv_transfer_config.kv_connector='NixlConnector' is replaced by 'RayNixlConnector'" in notes[0]
    assert "kv_transfer_config.kv_role='kv_both' is replaced by 'kv_producer'" in notes[1]
    assert "disable_log_stats" in notes[2]
    assert pd_overrides(EngineConfig(role="decode", engine_kwargs={"max_num_seqs": 3})) == []


def test_config_check_names_the_role_and_key():
    cfg = DeploymentConfig.from_dict({"decode": {"engine_kwargs": {"max_num_seqz": 4}}})
    with pytest.raises(ConfigError, match=r"decode\.engine_kwargs\.max_num_seqz: not a vLLM engine argument"):
        check_engine_args(cfg)
    shared = DeploymentConfig.from_dict({"engine_kwargs": {"swap_spaze": 4}})
    with pytest.raises(ConfigError, match=r" engine_kwargs\.swap_spaze"):
        check_engine_args(shared)
