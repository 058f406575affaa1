"""`raypd config` prints, after the deployment, the vLLM engine arguments each engine group will run
with on a CPU and on a GPU host, and why; the output still reads back as the same deployment."""

from __future__ import annotations

from pathlib import Path

import yaml

from actors.engine.vllm.args import platform_defaults
from serving.cli.engine_settings import EngineArg, engine_args, engine_args_comment
from serving.cli.main import main
from serving.config import DeploymentConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
GPU_EXAMPLE = ROOT / "configs" / "gpu-example.yaml"


def by_name(cfg: DeploymentConfig, role: str) -> dict[str, EngineArg]:
    return {a.name: a for a in engine_args(cfg, role)}


def test_gpu_example_a_gpu_engine_runs_vllm_serves_defaults_a_cpu_one_raypds():
    cfg = load_config(GPU_EXAMPLE)
    decode, prefill = by_name(cfg, "decode"), by_name(cfg, "prefill")
    budget = decode["max_num_batched_tokens"]
    assert (budget.cpu, budget.gpu) == (cfg.chunk_budget("decode"), None)  # None: `vllm serve`'s default
    assert "priors" in budget.why and "`vllm serve`'s default" in budget.why
    seqs = prefill["max_num_seqs"]
    assert (seqs.cpu, seqs.gpu) == (1, None)
    assert (decode["max_num_seqs"].cpu, decode["max_num_seqs"].gpu) == (None, None)
    assert (prefill["max_num_batched_tokens"].cpu, prefill["max_num_batched_tokens"].gpu) == (None, None)
    assert (decode["tensor_parallel_size"].cpu, decode["block_size"].gpu) == (4, 16)
    assert decode["kv_transfer_config"].cpu == "RayNixlConnector as kv_consumer"


def test_the_listing_is_what_the_engine_applies():
    cfg = load_config(GPU_EXAMPLE)
    for role in ("prefill", "decode"):
        e, listed = cfg.engine_config(role), by_name(cfg, role)
        for is_cpu in (True, False):
            for key, value in platform_defaults(e, is_cpu=is_cpu).items():
                assert (listed[key].cpu if is_cpu else listed[key].gpu) == value


def test_operator_written_values_are_listed_as_written_and_win():
    cfg = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "engine_kwargs": {"max_num_seqs": 8},
                                      "prefill": {"count": 1},
                                      "decode": {"count": 1, "engine_kwargs": {"max_num_batched_tokens": 4096}}})
    decode, prefill = by_name(cfg, "decode"), by_name(cfg, "prefill")
    assert (decode["max_num_batched_tokens"].cpu, decode["max_num_batched_tokens"].gpu) == (4096, 4096)
    assert decode["max_num_batched_tokens"].why == "written in decode.engine_kwargs"
    assert (prefill["max_num_seqs"].cpu, prefill["max_num_seqs"].why) == (8, "written in engine_kwargs")


def test_raypd_config_prints_the_engine_arguments_as_comments_that_read_back(capsys, tmp_path):
    assert main(["config", "--config", str(GPU_EXAMPLE)]) == 0
    text = capsys.readouterr().out
    assert "#   max_num_batched_tokens: CPU host 128 | GPU host vLLM's default\n" in text
    assert "#   max_num_seqs: CPU host 1 | GPU host vLLM's default\n" in text
    path = tmp_path / "again.yaml"
    path.write_text(text)
    assert load_config(path) == load_config(GPU_EXAMPLE)
    assert all(line.startswith("#") for line in text[text.index("# The vLLM engine arguments"):].splitlines())
    assert yaml.safe_load(text)["decode"]["tp_size"] == 4


def test_the_synthetic_backend_has_no_vllm_arguments():
    cfg = DeploymentConfig.from_dict({"backend": "synthetic"})
    assert engine_args_comment(cfg) == "# engines: the synthetic backend (no vLLM engine arguments)\n"
