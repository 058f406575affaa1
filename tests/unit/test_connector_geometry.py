"""vLLM cache tensors -> raypd geometry (no vLLM engine needed)."""

import pytest
import torch

from actors.connector.worker import geometry_from_vllm
from actors.kv.errors import LayoutError
from actors.kv.layout import CPU_HKND, NHD, canonical_view


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
