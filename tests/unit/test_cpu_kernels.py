"""The MLA attention backend raypd picks per host (AMX_MLA refuses float32 weights), fed each host's flags."""

import pytest

from actors.engine.vllm.cpu_kernels import CpuKernelError, host_has_amx, mla_backend_choice

AMX_HOST = frozenset("fpu avx512f avx512_bf16 amx_bf16 amx_int8 amx_tile".split())
AVX512_HOST = frozenset("fpu avx2 avx512f avx512bw".split())


def test_an_amx_host_runs_a_float32_mla_model_on_the_portable_backend():
    choice = mla_backend_choice(AMX_HOST, "x86_64", use_mla=True, dtype="float32", user_backend=None)
    assert (choice.backend, choice.runs) == ("CPU_MLA", "CPU_MLA")


def test_an_amx_host_keeps_vllms_amx_backend_for_bfloat16():
    choice = mla_backend_choice(AMX_HOST, "x86_64", use_mla=True, dtype="bfloat16", user_backend=None)
    assert (choice.backend, choice.runs) == (None, "AMX_MLA")


def test_a_host_without_amx_leaves_vllms_choice():
    choice = mla_backend_choice(AVX512_HOST, "x86_64", use_mla=True, dtype="float32", user_backend=None)
    assert (choice.backend, choice.runs) == (None, "CPU_MLA")


def test_amx_flags_on_arm_are_not_amx():
    assert host_has_amx(AMX_HOST, "aarch64") is False


def test_a_model_without_mla_is_left_alone():
    assert mla_backend_choice(AMX_HOST, "x86_64", use_mla=False, dtype="float32", user_backend=None).runs is None


def test_asking_for_amx_in_float32_is_refused_with_the_fix_named():
    with pytest.raises(CpuKernelError, match="set dtype: bfloat16"):
        mla_backend_choice(AMX_HOST, "x86_64", use_mla=True, dtype="float32", user_backend="AMX_MLA")


def test_the_operators_own_backend_stands():
    choice = mla_backend_choice(AMX_HOST, "x86_64", use_mla=True, dtype="float32", user_backend="CPU_MLA")
    assert (choice.backend, choice.runs) == (None, "CPU_MLA")
