"""Engine settings on every shipped config (configs/*.yaml, the KubeRay manifests and their renders):
on a GPU host no engine runs with a max_num_batched_tokens or a max_num_seqs of 1 that the operator
did not write (vLLM's own defaults stand); on a CPU host raypd's tuned defaults apply."""

from pathlib import Path

import pytest
import yaml

from actors.engine.vllm.args import platform_defaults
from serving.config import ROLES, DeploymentConfig, load_config

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


def written(cfg: DeploymentConfig, role: str) -> dict:
    return {**cfg.engine_kwargs, **getattr(cfg, role).engine_kwargs}


def test_on_a_cpu_host_the_default_gets_its_chunk_budget_and_fcfs_prefills():
    both = load_config(ROOT / "configs/local.yaml").engine_config("both")
    prefill = load_config(ROOT / "configs/local-pd.yaml").engine_config("prefill")
    assert (platform_defaults(both, is_cpu=True), platform_defaults(prefill, is_cpu=True)["max_num_seqs"]) == (
        {"max_num_batched_tokens": 128}, 1)


def test_a_value_the_operator_wrote_wins_on_a_cpu_host_too():
    cfg = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "prefill": {"count": 1},
                                      "decode": {"count": 1, "engine_kwargs": {"max_num_batched_tokens": 4096}}})
    e = cfg.engine_config("decode")
    assert ({**platform_defaults(e, is_cpu=True), **e.engine_kwargs}["max_num_batched_tokens"]) == 4096
