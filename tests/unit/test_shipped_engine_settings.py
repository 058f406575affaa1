"""Engine settings on every shipped config (configs/*.yaml, the KubeRay manifests and their renders):
on a GPU host no engine runs with a max_num_batched_tokens or a max_num_seqs of 1 that the operator
did not write, every GPU engine runs the batch defaults `vllm serve` gives its GPU (vLLM's own table,
fed an H100's, an H200's and an A100's device name and memory), and once engines measured their
rates no engine runs a budget below vLLM's default or max_num_seqs 1 unless the operator wrote it;
on a CPU host raypd's tuned defaults apply."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from actors.engine.vllm import serve_defaults
from actors.engine.vllm.args import platform_defaults
from actors.engine.vllm.serve_defaults import BatchDefaults, serve_batch_defaults, usage_context
from serving.config import DECODE_DEFAULT_KWARGS, ROLES, DeploymentConfig, load_config
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
        {"max_num_batched_tokens": 128, "distributed_executor_backend": "uni", **DECODE_DEFAULT_KWARGS}, 1)


def test_a_value_the_operator_wrote_wins_on_a_cpu_host_too():
    cfg = DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "prefill": {"count": 1},
                                      "decode": {"count": 1, "engine_kwargs": {"max_num_batched_tokens": 4096}}})
    e = cfg.engine_config("decode")
    assert ({**platform_defaults(e, is_cpu=True), **e.engine_kwargs}["max_num_batched_tokens"]) == 4096


# ------------------------------------------------ `vllm serve`'s defaults on each GPU, from vLLM's table
GIB = 1 << 30


class Device:
    """A stand-in for vLLM's `current_platform`: the device name and memory vLLM's default table reads."""

    def __init__(self, name: str, memory_gib: float, cpu: bool = False):
        self.name, self.memory, self.cpu = name, int(memory_gib * GIB), cpu

    def get_device_name(self, device_id: int = 0) -> str:
        return self.name

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.memory

    def is_cpu(self) -> bool:
        return self.cpu

    def is_tpu(self) -> bool:
        return False


# as torch reports them: name, total memory; and what `vllm serve` gives a one-rank engine there
DEVICES = {
    "H100": (Device("NVIDIA H100 80GB HBM3", 79.2), BatchDefaults(8192, 1024)),
    "H200": (Device("NVIDIA H200", 139.8), BatchDefaults(8192, 1024)),
    "A100": (Device("NVIDIA A100-SXM4-80GB", 79.2), BatchDefaults(2048, 256)),
    "CPU": (Device("cpu", 64.0, cpu=True), BatchDefaults(2048, 128)),
}
GPUS = [name for name, (device, _) in DEVICES.items() if not device.cpu]


@pytest.fixture
def on_device(monkeypatch):
    """Stand a device in for this host's in vLLM's default table (and forget what was read before)."""
    pytest.importorskip("vllm")
    import vllm.engine.arg_utils as arg_utils

    def use(name: str) -> BatchDefaults:
        monkeypatch.setattr(arg_utils, "current_platform", DEVICES[name][0])
        serve_defaults.clear_cache()
        return DEVICES[name][1]

    yield use
    serve_defaults.clear_cache()


@pytest.mark.parametrize("device", list(DEVICES))
def test_vllms_own_table_gives_what_vllm_serve_gives_on_each_device(on_device, device):
    want = on_device(device)
    assert (serve_batch_defaults(), usage_context().name) == (want, "OPENAI_API_SERVER")


def vllm_resolves(e, written: dict, serve: BatchDefaults) -> BatchDefaults:
    """What vLLM makes of the engine's batch settings (`EngineArgs`' own defaulting, in the usage
    context raypd's engines are built with): the operator's and raypd's values, else its table's."""
    from vllm.engine.arg_utils import EngineArgs

    run = {**platform_defaults(e, is_cpu=False, serve=serve), **e.engine_kwargs}
    args = EngineArgs(model=".", tensor_parallel_size=e.tp_size, pipeline_parallel_size=e.pp_size,
                      max_num_batched_tokens=run.get("max_num_batched_tokens"), max_num_seqs=run.get("max_num_seqs"),
                      performance_mode=run.get("performance_mode", "balanced"), enable_chunked_prefill=True)
    model = SimpleNamespace(max_model_len=e.max_model_len, is_multimodal_model=False, is_mm_prefix_lm=False)
    args._set_default_max_num_seqs_and_batched_tokens_args(usage_context(), model,
                                                            SimpleNamespace(use_batched_dp_moe=False))
    return BatchDefaults(args.max_num_batched_tokens, args.max_num_seqs)


GPU_SHIPPED = [(n, c) for n, c in SHIPPED if n == "gpu-example.yaml" or any(
    doc_name == n and "nvidia.com/gpu" in yaml.safe_dump(doc) for doc_name, doc in SERVICES)]


def test_the_gpu_configs_and_manifests_are_checked():
    names = [n for n, _ in GPU_SHIPPED]
    assert "gpu-example.yaml" in names and len(names) >= 2, names


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("name, cfg", GPU_SHIPPED, ids=[n for n, _ in GPU_SHIPPED])
def test_gpu_engines_run_vllm_serves_defaults_for_their_gpu_unless_the_file_sets_them(on_device, device, name, cfg):
    on_device(device)
    got, want = {}, {}
    for role, e in engines(cfg):
        ours = written(cfg, role)
        serve = serve_batch_defaults(e.tp_size * e.pp_size, ours.get("performance_mode"))
        got[role] = vllm_resolves(e, ours, serve)
        want[role] = BatchDefaults(ours.get("max_num_batched_tokens", serve.max_num_batched_tokens),
                                   ours.get("max_num_seqs", serve.max_num_seqs))
    assert got == want


def test_engines_are_built_in_vllm_serves_usage_context():
    backend = (ROOT / "actors/engine/vllm/backend.py").read_text()
    assert "from_engine_args(engine_args, usage_context=usage_context()," in backend
