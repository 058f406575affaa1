"""Which vLLM CPU attention kernel an MLA model gets on this host, decided before the engine starts.

vLLM 0.32's CPU platform serves MLA models (DeepSeek-V2/V3 style) with one of two backends:

  AMX_MLA   picked whenever the x86 CPU has AMX tiles (`amx_tile` in /proc/cpuinfo); its
            `process_weights_after_loading` packs the weights and refuses float32 ("expect
            weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"): the engine dies at start;
  CPU_MLA   the portable reference backend (any CPU, any dtype vLLM supports on CPU, block size 16).

raypd's CPU default dtype is float32 (configs/local.yaml). So on an AMX host an MLA model in
float32 gets CPU_MLA (`attention_config.backend`), the dtype the operator chose stands, and the
same engine starts on every CPU. An operator who asks for AMX_MLA in float32 is refused before
anything starts, with the fix named. bfloat16/float16 keep vLLM's own choice (AMX where present).

`mla_backend_choice` is pure (flags in, choice out): unit tests feed it the flags of an AMX host.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

AMX_FLAG = "amx_tile"  # what torch.cpu._is_amx_tile_supported() reports, as /proc/cpuinfo names it
AMX_DTYPES = frozenset({"bfloat16", "float16"})  # what AMX_MLA packs (besides quantized weights)


class CpuKernelError(ValueError):
    """An engine setting the host's vLLM CPU kernels refuse; the message names the fix."""


@dataclass(frozen=True)
class MlaBackendChoice:
    backend: str | None  # vLLM's AttentionBackendEnum name to set; None: leave vLLM's own choice
    runs: str | None  # the MLA backend the engine will run (None: not an MLA model)
    reason: str


@functools.lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    """This host's CPU flags (/proc/cpuinfo; empty where it has none, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_has_amx(flags: frozenset[str] | None = None, machine: str | None = None) -> bool:
    machine = (machine or platform.machine()).lower()
    return machine in ("x86_64", "amd64") and AMX_FLAG in (host_cpu_flags() if flags is None else flags)


def mla_backend_choice(flags: frozenset[str], machine: str, use_mla: bool, dtype: str,
                       user_backend: str | None) -> MlaBackendChoice:
    """The attention backend an engine of this model and dtype must run with on a CPU with `flags`."""
    if not use_mla:
        return MlaBackendChoice(None, None, "not an MLA model")
    if not host_has_amx(flags, machine):
        return MlaBackendChoice(None, "CPU_MLA", "no AMX: vLLM picks its portable CPU_MLA backend")
    if dtype in AMX_DTYPES and user_backend in (None, "AMX_MLA"):
        return MlaBackendChoice(None, "AMX_MLA", f"AMX host, {dtype}: vLLM's AMX_MLA backend accepts it")
    if user_backend == "AMX_MLA":
        raise CpuKernelError(
            f"attention_config.backend AMX_MLA cannot run a {dtype} MLA model (it packs bfloat16/float16 "
            f"weights only): set dtype: bfloat16, or drop the backend to let raypd pick CPU_MLA")
    if user_backend is not None:
        return MlaBackendChoice(None, user_backend, f"the operator chose {user_backend}")
    return MlaBackendChoice("CPU_MLA", "CPU_MLA", f"AMX host, {dtype}: vLLM's AMX_MLA refuses {dtype} weights, "
                                       f"so the portable CPU_MLA backend runs the model")
