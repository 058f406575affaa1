"""`benchmarks/gpu_kv.py` on CPU, tiny shapes: the device check's code path runs in CI.

The benchmark spawns its own producer and consumer processes (NIXL over UCX,
no Ray); here every variant (tp 1 -> 1, tp 2 -> 1, block-size ratio 2) and
pattern must pull, verify every byte, and write a results file whose header
names the command, the commit and the host.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)

TINY = ["--device", "cpu", "--layers", "2", "--heads", "2", "--head-size", "32", "--dtype", "bfloat16",
        "--tokens", "64,128", "--patterns", "contiguous,scattered,churned", "--reps", "2", "--handshake-reps", "2"]


def test_every_variant_pulls_and_verifies_every_byte(tmp_path):
    from benchmarks import gpu_kv

    assert gpu_kv.main([*TINY, "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_kv.json").read_text())
    assert [v["variant"] for v in res["variants"]] == ["base", "tp2to1", "ratio2"]
    for part in res["variants"]:
        assert part["error"] is None
        assert len(part["rows"]) == 2 * 3
        for row in part["rows"]:
            # 2 reps x every block of 2 layers x 2 planes x (2 heads x 16 tokens x 32 dims x 2 bytes)
            blocks = row["tokens"] // 16
            assert row["verified_bytes"] == 2 * blocks * 2 * 2 * (2 * 16 * 32 * 2) == 2 * row["bytes"]
            assert row["pull_s"] > 0 and row["gather_s"] > 0
        assert part["copy_gbps"] > 0
        assert len(part["handshakes_s_per_peer"]) == 2
    text = (tmp_path / "gpu_kv.txt").read_text()
    header = text.splitlines()[:5]
    assert header[1].startswith("# command: ") and "gpu_kv.py" in header[1]
    assert header[2].startswith("# commit: ") and "code sha256" in header[2]
    assert header[3].startswith("# host: ")
    assert "bytes verified" in text and "FAILED" not in text
