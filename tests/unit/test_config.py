"""Deployment config: the shipped files load; bad input is refused naming the field."""

from pathlib import Path

import pytest

from serving.config import DECODE_DEFAULT_KWARGS, ConfigError, DeploymentConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["local.yaml", "local-pd.yaml", "synthetic.yaml", "gpu-example.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.decode.count + cfg.both.count >= 1
    assert cfg.engine_config("decode").role == "decode"


def test_local_default_is_smollm2_two_role_flexible_engines_with_slo_placement_on_loopback():
    cfg = load_config(CONFIGS / "local.yaml")
    assert (cfg.backend, cfg.model, cfg.prefill.count, cfg.decode.count, cfg.both.count) == ("vllm", "smollm2",
                                                                                             0, 0, 2)
    assert (cfg.router.placement, cfg.http.host, cfg.http.port) == ("slo", "127.0.0.1", 8000)
    assert [cfg.engine_config("both", i).cpu.bind for i in range(2)] == ["0", "1"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"decode": {"count": 0}}, "at least one decode-capable engine"),
        ({"prefill": {"tp_size": 3}, "decode": {"tp_size": 2}}, "must divide one another"),
        ({"prefill": {"block_size": 48}, "decode": {"block_size": 32}}, "must divide decode block_size"),
        ({"backend": "synthetic", "decode": {"tp_size": 3}}, "num_kv_heads"),
        ({"backend": "synthetic", "decode": {"tp_size": 2, "dcp_size": 2}}, "MLA"),
        ({"decode": {"tp_size": 2, "dcp_size": 2}}, "synthetic backend"),
        ({"prefill": {"count": 2, "cpu": {"bind": ["0"]}}}, "one entry per engine"),
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


# ------------------------------------------------------------------ engine_kwargs
def on_cpu(engine) -> dict:
    """The engine arguments an engine runs with on a CPU host (its kwargs over raypd's CPU defaults)."""
    from actors.engine.vllm.args import platform_defaults

    return {**platform_defaults(engine, is_cpu=True), **engine.engine_kwargs}


def test_engine_kwargs_reach_each_role_and_the_role_wins():
    cfg = DeploymentConfig.from_dict({
        "engine_kwargs": {"max_num_seqs": 64, "enable_prefix_caching": False},
        "decode": {"engine_kwargs": {"max-num-seqs": 8, "gpu_memory_utilization": 0.8}},
    })
    uni = {"distributed_executor_backend": "uni"}  # raypd's CPU default for one-rank engines
    assert on_cpu(cfg.engine_config("prefill")) == {"max_num_seqs": 64, "enable_prefix_caching": False, **uni}
    assert on_cpu(cfg.engine_config("decode")) == {"max_num_seqs": 8, "enable_prefix_caching": False,
                                                   "gpu_memory_utilization": 0.8, **uni,
                                                   "max_num_batched_tokens": 128,  # raypd's chunk budget
                                                   **DECODE_DEFAULT_KWARGS}


def test_owned_engine_kwargs_move_into_raypds_fields():
    cfg = DeploymentConfig.from_dict({
        "engine_kwargs": {"max_model_len": 4096, "dtype": "bfloat16", "block_size": 32},
        "prefill": {"engine_kwargs": {"tensor_parallel_size": 2}},
        "decode": {"engine_kwargs": {"block_size": 64, "tensor_parallel_size": 2}},
    })
    assert (cfg.max_model_len, cfg.dtype) == (4096, "bfloat16")
    assert (cfg.prefill.tp_size, cfg.prefill.block_size, cfg.decode.tp_size, cfg.decode.block_size) == (2, 32, 2, 64)
    assert cfg.engine_kwargs == {} and cfg.prefill.engine_kwargs == {} and cfg.decode.engine_kwargs == {}
    assert DeploymentConfig.from_dict(cfg.model_dump(mode="json")) == cfg  # one value, one place


def test_defaults_follow_vllm_but_decode_capable_engines_get_a_chunk_budget_within_the_itl_target():
    cfg = DeploymentConfig.from_dict({})
    uni = {"distributed_executor_backend": "uni"}  # one rank: the model in the core process
    assert cfg.dtype == "auto" and on_cpu(cfg.engine_config("prefill")) == {"max_num_seqs": 1, **uni}  # FCFS prefills
    # a step with a local prefill chunk stays near the ITL target (prior rates; vLLM's floor: one block)
    assert on_cpu(cfg.engine_config("decode")) == {"max_num_batched_tokens": 128, **uni, **DECODE_DEFAULT_KWARGS}
    disagg = DeploymentConfig.from_dict({"router": {"placement": "disaggregate"}}).engine_config("decode")
    assert on_cpu(disagg) == {**uni, **DECODE_DEFAULT_KWARGS}


def test_both_alone_means_no_fixed_pools():
    cfg = DeploymentConfig.from_dict({"both": {"count": 3}})
    assert (cfg.prefill.count, cfg.decode.count, cfg.both.count) == (0, 0, 3)
    assert cfg.engine_config("both").role == "both"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"prefill": {"tp_size": 2, "engine_kwargs": {"tensor_parallel_size": 4}}},
         r"prefill.engine_kwargs.tensor_parallel_size=4 contradicts prefill.tp_size=2"),
        ({"max_model_len": 1024, "engine_kwargs": {"max_model_len": 2048}},
         r"engine_kwargs.max_model_len=2048 contradicts max_model_len=1024"),
        ({"prefill": {"engine_kwargs": {"dtype": "float16"}}, "decode": {"engine_kwargs": {"dtype": "bfloat16"}}},
         r"decode.engine_kwargs.dtype='bfloat16' contradicts prefill.engine_kwargs.dtype='float16'"),
        ({"decode": {"block_size": 32}, "engine_kwargs": {"block_size": 64}},
         r"engine_kwargs.block_size=64 contradicts decode.block_size=32"),
        ({"engine_kwargs": {"data_parallel_size": 2}}, "prefill.count / decode.count"),
        ({"http": {"api_keys": ["sk-1"]}}, "RAYPD_API_KEYS.*http.api_keys_file"),
    ],
)
def test_contradictions_and_refused_settings_say_where(data, message):
    with pytest.raises(ConfigError, match=message):
        DeploymentConfig.from_dict(data)


def test_served_model_name_follows_vllm_for_hub_ids_and_folders():
    assert DeploymentConfig.from_dict({"model": "org/Some-Model"}).served_model_name == "org/Some-Model"
    assert DeploymentConfig.from_dict({"model": "/models/Llama-3/"}).served_model_name == "Llama-3"
    assert DeploymentConfig.from_dict({}).served_model_name == "smollm2"


def test_cache_aware_routing_is_the_default_and_turns_the_engines_kv_events_on():
    from serving.routing.planner import planner_for

    cache_aware = DeploymentConfig.from_dict({"backend": "synthetic"})
    by_load = DeploymentConfig.from_dict({"backend": "synthetic", "router": {"policy": "least_outstanding"}})
    assert [c.engine_config(r).kv_events for c in (cache_aware, by_load) for r in ("prefill", "decode")] == [
        True, True, False, False]
    assert planner_for(by_load.router).settings.cache_weight == 0.0


def test_a_prefill_engine_runs_one_prompt_at_a_time_unless_its_engine_kwargs_say_otherwise():
    """vLLM would pack queued prompts into one step (each gets its first token when the whole pack is
    done); raypd's prefill engines default to max_num_seqs 1 (FCFS). Decode engines keep vLLM's default."""
    cfg = DeploymentConfig.from_dict({"backend": "vllm", "model": "m"})
    assert on_cpu(cfg.engine_config("prefill"))["max_num_seqs"] == 1
    assert "max_num_seqs" not in on_cpu(cfg.engine_config("decode"))
    own = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "prefill": {"engine_kwargs": {"max_num_seqs": 8}}})
    assert on_cpu(own.engine_config("prefill"))["max_num_seqs"] == 8
    shared = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "engine_kwargs": {"max_num_seqs": 4}})
    assert on_cpu(shared.engine_config("prefill"))["max_num_seqs"] == 4


def test_every_restarted_actor_follows_restarts_max_restarts():
    """Engines, their rank actors (synthetic), the coordinator and the launcher (the autoscaler runs in it):
    one bound."""
    from serving.cluster.launcher import launcher_options

    cfg = DeploymentConfig.from_dict({"backend": "synthetic", "restarts": {"max_restarts": 2}})
    assert cfg.engine_config("prefill").max_restarts == cfg.engine_config("decode").max_restarts == 2
    assert launcher_options(cfg)["max_restarts"] == 2  # bounded, never -1


def test_cpu_host_and_synthetic_settings_sit_in_their_blocks_and_reach_each_engine():
    cfg = DeploymentConfig.from_dict({"backend": "synthetic", "prefill": {"count": 0},
                                      "decode": {"count": 2, "cpu": {"bind": ["0", "1"], "compute_nice": 5},
                                                 "synthetic": {"num_blocks": 64, "layout": "NHD"}}})
    engine = cfg.engine_config("decode", 1)
    assert (engine.cpu.bind, engine.cpu.compute_nice, engine.synthetic.num_blocks, engine.synthetic.layout,
            engine.synthetic.model_id) == ("1", 5, 64, "NHD", "synthetic-tiny")


def test_a_file_written_before_the_cpu_and_synthetic_blocks_still_loads():
    old = DeploymentConfig.from_dict({"decode": {"cpu_bind": ["1"], "shm_busy_loop_s": 0, "num_blocks": 64}})
    assert (old.decode.cpu.bind, old.decode.cpu.shm_busy_loop_s, old.decode.synthetic.num_blocks) == (["1"], 0, 64)
    with pytest.raises(ConfigError, match="cpu_bind and cpu.bind both set"):
        DeploymentConfig.from_dict({"decode": {"cpu_bind": ["1"], "cpu": {"bind": ["0"]}}})


def test_the_router_takes_what_it_needs_of_transfer_and_breaker_unless_router_sets_it():
    derived = DeploymentConfig.from_dict({"transfer": {"read_timeout_s": 20}, "breaker": {"probe_window_s": 8}})
    own = DeploymentConfig.from_dict({"transfer": {"read_timeout_s": 20},
                                      "router": {"pull_timeout_s": 5, "probe_hold_s": 1}})
    assert ((derived.router_config().pull_timeout_s, derived.router_config().probe_hold_s),
            (own.router_config().pull_timeout_s, own.router_config().probe_hold_s)) == ((20, 4.0), (5, 1))
