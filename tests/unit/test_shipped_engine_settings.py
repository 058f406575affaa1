"""Engine settings on every shipped config (configs/*.yaml, the KubeRay manifests and their renders):
on a GPU host no engine runs with a max_num_batched_tokens or a max_num_seqs of 1 that the operator
did not write (vLLM's own defaults stand), and once engines measured their rates no engine runs a
budget below vLLM's default or max_num_seqs 1 unless the operator wrote it; on a CPU host raypd's
tuned defaults apply."""

from pathlib import Path

import pytest
import yaml

from actors.engine.vllm.args import platform_defaults
from serving.config import ROLES, DeploymentConfig, load_config
from serving.placement_config import MeasuredRates, vllm_default_budget

from test_k8s_manifests import SERVICES, args_of

ROOT = Path(__file__).resolve().parents[2]


def shipped_configs() -> list[tuple[str, DeploymentConfig]]:
    """Every deployment file, the raypd apps of Serve config files, and every KubeRay RayService."""
    found = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if "applications" in data:  # a Serve config file: its raypd applications' inline deployments
            found += [(f"{path.name}:{app['name']}", DeploymentConfig.from_dict(app["args"]))
                      for app in data["applications"] if "config_path" not in app.get("args", {"config_path": 1})]
        else:
            found.append((path.name, load_config(path)))
    return found + [(name, DeploymentConfig.from_dict(args_of(doc))) for name, doc in SERVICES]


SHIPPED = shipped_configs()


def engines(cfg: DeploymentConfig):
    return [(role, cfg.engine_config(role)) for role in ROLES if getattr(cfg, role).count]


@pytest.mark.parametrize("name, cfg", SHIPPED, ids=[n for n, _ in SHIPPED])
def test_a_gpu_engine_runs_vllms_defaults_unless_the_operator_wrote_a_value(name, cfg):
    raypd_set = {(role, key): value for role, e in engines(cfg)
                 for key, value in {**platform_defaults(e, is_cpu=False), **e.engine_kwargs}.items()
                 if key in ("max_num_batched_tokens", "max_num_seqs") and key not in written(cfg, role)}
    assert raypd_set == {}


# what engines of a role may have measured when the autoscaler starts one more: slow, CPU-like, and
# fast, GPU-like (a budget above vLLM's default, which a GPU engine then runs)
MEASURED = {"unmeasured": None, "slow": MeasuredRates(400.0, 0.05), "fast": MeasuredRates(30000.0, 0.02)}


@pytest.mark.parametrize("measured", MEASURED.values(), ids=list(MEASURED))
@pytest.mark.parametrize("name, cfg", SHIPPED, ids=[n for n, _ in SHIPPED])
def test_no_gpu_engine_runs_a_budget_below_vllms_default_or_one_seq_unless_written(name, cfg, measured):
    below = {}
    for role, _ in engines(cfg):
        ours = written(cfg, role)
        e = cfg.engine_config(role, measured=measured)
        run = {**platform_defaults(e, is_cpu=False), **e.engine_kwargs}
        if "max_num_batched_tokens" in run and "max_num_batched_tokens" not in ours:
            if run["max_num_batched_tokens"] < vllm_default_budget(ours):
                below[(role, "max_num_batched_tokens")] = run["max_num_batched_tokens"]
        if run.get("max_num_seqs") == 1 and "max_num_seqs" not in ours:
            below[(role, "max_num_seqs")] = 1
    assert below == {}


def written(cfg: DeploymentConfig, role: str) -> dict:
    return {**cfg.engine_kwargs, **getattr(cfg, role).engine_kwargs}


def test_on_a_cpu_host_the_default_gets_its_chunk_budget_and_fcfs_prefills():
    both = load_config(ROOT / "configs/local.yaml").engine_config("both")
    prefill = load_config(ROOT / "configs/local-pd.yaml").engine_config("prefill")
    assert (platform_defaults(both, is_cpu=True), platform_defaults(prefill, is_cpu=True)["max_num_seqs"]) == (
        {"max_num_batched_tokens": 128, "distributed_executor_backend": "uni"}, 1)


def test_a_value_the_operator_wrote_wins_on_a_cpu_host_too():
    cfg = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "prefill": {"count": 1},
                                      "decode": {"count": 1, "engine_kwargs": {"max_num_batched_tokens": 4096}}})
    e = cfg.engine_config("decode")
    assert ({**platform_defaults(e, is_cpu=True), **e.engine_kwargs}["max_num_batched_tokens"]) == 4096
