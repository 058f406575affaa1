"""vLLM cache tensors and parallel config -> raypd geometry and DCP size (no vLLM engine needed)."""

from types import SimpleNamespace

import pytest
import torch

from actors.engine.vllm.connector.worker import check_supported, geometry_from_vllm
from actors.kv.transfer_errors import LayoutError, TopologyError
from actors.kv.plan.layout import CPU_HKND, MLA_ND, NHD, canonical_view


def test_cpu_layout_matches_how_the_cpu_backend_reads_it():
    buf = torch.arange(2 * 5 * 3 * 8 * 2 * 4, dtype=torch.float32).view(2, 5, 3, 8, 8)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in (1, 0)}
    geometry, planes = geometry_from_vllm(caches, block_size=8)
    assert geometry.layout == CPU_HKND and geometry.num_layers == 2 and geometry.head_size == 4
    layer0 = caches["model.layers.0.self_attn.attn"]
    k, v = layer0.view(5, 3, 16, 4).chunk(2, dim=2)  # what cpu_attn.py does
    view = canonical_view(planes[0][0], CPU_HKND)  # [blocks, KV, H, N, D]
    assert torch.equal(view[:, 0], k) and torch.equal(view[:, 1], v)
    assert geometry.bases[1][0] - geometry.bases[0][0] == layer0.numel() * 4


def test_flash_attention_planes():
    caches = {f"model.layers.{i}.attn": torch.zeros(2, 6, 16, 2, 64) for i in range(3)}
    geometry, planes = geometry_from_vllm(caches, block_size=16)
    assert geometry.layout == NHD and geometry.planes == 2 and geometry.num_heads == 2


def test_unsupported_shapes_are_clear_errors():
    with pytest.raises(LayoutError, match="unsupported KV cache shape"):
        geometry_from_vllm({"model.layers.0.attn": torch.zeros(4, 4, 4)}, block_size=16)
    with pytest.raises(LayoutError, match="not consecutive"):
        geometry_from_vllm({"model.layers.0.a": torch.zeros(2, 1, 8, 8), "model.layers.2.a": torch.zeros(2, 1, 8, 8)}, 8)
    with pytest.raises(LayoutError, match="no KV cache"):
        geometry_from_vllm({}, 8)


def test_mla_latent_cache_is_one_row_per_token():
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(7, 16, 576) for i in range(2)}
    geometry, planes = geometry_from_vllm(caches, block_size=16, use_mla=True)
    assert geometry.layout == MLA_ND and geometry.num_heads == 1 and geometry.head_size == 576
    assert geometry.planes == 1 and geometry.block_bytes == 16 * 576 * 4
    cpu = {f"model.layers.{i}.self_attn.attn": torch.zeros(7, 1, 16, 576) for i in range(2)}  # vLLM CPU MLA
    geometry, planes = geometry_from_vllm(cpu, block_size=16, use_mla=True)
    assert geometry.layout == MLA_ND and planes[0][0].shape == (7, 16, 576)
    with pytest.raises(LayoutError, match="unsupported MLA KV cache shape"):
        geometry_from_vllm({"model.layers.0.attn": torch.zeros(2, 6, 16, 2, 64)}, block_size=16, use_mla=True)


def vllm_config(tp=1, dcp=1, pcp=1, interleave=1, use_mla=False):
    parallel = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=pcp, cp_kv_cache_interleave_size=interleave)
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(use_mla=use_mla))


def test_dcp_comes_from_vllms_parallel_config():
    assert check_supported(vllm_config(tp=4, dcp=4, use_mla=True)) == 4
    assert check_supported(vllm_config(tp=2)) == 1


@pytest.mark.parametrize("kwargs, named", [
    (dict(tp=4, dcp=2, use_mla=True), "decode_context_parallel_size=2 with tensor_parallel_size=4"),
    (dict(tp=2, dcp=2, use_mla=False), "decode_context_parallel_size=2 without MLA"),
    (dict(tp=2, dcp=2, use_mla=True, interleave=16), "cp_kv_cache_interleave_size=16"),
    (dict(tp=2, pcp=2), "prefill_context_parallel_size=2"),
])
def test_unsupported_parallel_combinations_are_refused_by_name(kwargs, named):
    with pytest.raises(TopologyError, match=named):
        check_supported(vllm_config(**kwargs))
