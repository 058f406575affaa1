"""Provenance (command, commit, host, device) and the text table of `benchmarks/gpu_kv.py`'s results.

The commit comes from git when the tree is a checkout, else from `RAYPD_COMMIT`
(the device machine gets a copy of the working tree without `.git`); the
tree fingerprint (sha256 of the code that ran) is recorded either way, so a
results file can be matched to its code.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

FINGERPRINTED = ("actors/kv", "benchmarks/gpu_kv.py", "benchmarks/gpu_kv_ranks.py", "benchmarks/kv_patterns.py")
VARIANT_NOTES = {
    "base": "producer tp 1 -> consumer tp 1, block 16",
    "tp2to1": "producer tp 2 (two ranks, half the heads each) -> consumer tp 1: two READs per pull",
    "ratio2": "producer block 16 -> consumer block 32: two remote blocks per local block, permuted on receive",
}


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for entry in FINGERPRINTED:
        path = root / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def provenance(root: Path, device: str) -> dict:
    commit, source = _git(root, "rev-parse", "HEAD"), "git"
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no")) if commit else None
    if commit is None:
        commit, source = os.environ.get("RAYPD_COMMIT") or "unknown", "RAYPD_COMMIT"
    info = {"commit": commit, "commit_source": source, "dirty": dirty, "tree_sha256": fingerprint(root)}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["device_name"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    except Exception as exc:  # the table still records what ran
        info["device_name"] = f"unknown ({type(exc).__name__}: {exc})"
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
            try:
                info["nixl"] = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                continue
    except ImportError:
        pass
    return info


def table(res: dict) -> str:
    env = " ".join(f"{k}={v}" for k, v in sorted(res["env"].items())) or "UCX/NIXL defaults"
    h = res["host"]
    lines = [
        f"# {res['date']}",
        f"# command: {res['command']}",
        f"# commit: {res['commit']}{' (dirty)' if res.get('dirty') else ''} (from {res['commit_source']}), "
        f"code sha256 {res['tree_sha256']}",
        f"# host: {h['name']}, {h['cpus']} CPUs, {h['platform']}, Python {h['python']}",
        f"# device: {res.get('device_name')}, torch {res.get('torch')} (CUDA {res.get('torch_cuda')}), "
        f"{res.get('nixl', 'nixl ?')}; {env}",
        "KV pull between two processes through raypd's actors/kv (RankTransfer over NixlTransport) vs the same "
        f"device's gather and copy; medians of {res['settings']['reps']} reps, every pulled byte verified",
    ]
    mib = 2**20
    for part in res["variants"]:
        s = part["spec"]
        lines += ["", f"variant {part['variant']}: {VARIANT_NOTES.get(part['variant'], '')}; {s['layers']} layers x "
                      f"{s['heads']} kv heads x {s['head_size']}, {s['dtype']}, HND, on {s['device']}"]
        if part["error"]:
            lines.append(f"FAILED: {part['error'].strip().splitlines()[-1]}")
        copy = part["copy_gbps"]
        hdr = (f"{'tokens':>6} {'pattern':<10} {'MiB':>7} {'descs':>6} {'spans':>6} {'pull ms':>8} {'gather ms':>9} "
               f"{'pull GB/s':>9} {'gather GB/s':>11} {'pull/gather':>11} {'pull/copy':>9}")
        if part["rows"]:
            lines += [hdr, "-" * len(hdr)]
        for r in part["rows"]:
            vs_copy = f"{r['pull_gbps'] / copy:>9.3f}" if copy else f"{'-':>9}"
            lines.append(f"{r['tokens']:>6} {r['pattern']:<10} {r['bytes'] / mib:>7.1f} {r['descriptors']:>6} "
                         f"{r['spans']:>6} {r['pull_s'] * 1e3:>8.2f} {r['gather_s'] * 1e3:>9.2f} "
                         f"{r['pull_gbps']:>9.2f} {r['gather_gbps']:>11.2f} {r['ratio_pull_over_gather']:>11.2f} "
                         f"{vs_copy}")
        for r in part["rows"]:
            if r["tokens"] in (4096, 8192):
                verdict = "meets" if r["ratio_pull_over_gather"] >= 0.8 else "BELOW"
                lines.append(f"goal ({part['variant']}, {r['tokens']} tokens, {r['pattern']}): pull/gather = "
                             f"{r['ratio_pull_over_gather']:.2f} -> {verdict} the 0.8 goal")
        verified = sum(r["verified_bytes"] for r in part["rows"])
        if part["rows"]:
            lines.append(f"bytes verified: {verified} ({verified / mib:.1f} MiB, every pulled byte of every rep)")
        if copy:
            lines.append(f"device copy bandwidth: {copy:.2f} GB/s (one contiguous copy of the largest pull)")
        hs = part["handshakes_s_per_peer"]
        if hs:
            worst = max(hs)
            lines.append(f"first handshake per peer rank ({s['producer_tp']} peer ranks): first {hs[0] * 1e3:.1f} ms, "
                         f"all {', '.join(f'{x * 1e3:.1f}' for x in hs)} ms -> "
                         f"{'meets' if worst <= 0.050 else 'BELOW'} the 50 ms goal")
    lines += [
        "",
        "pull = RankTransfer.start_pull -> step() until done + device sync (plan lookup, id checks, descriptor",
        "  indices, NIXL post, completion, the lease confirmation, layout permute on receive); gather = index_select",
        "  + index_copy_ of the same blocks per (layer, plane) on the same device; copy = one contiguous copy;",
        "  descs = descriptors posted, spans = extents once NIXL merged pairs adjacent in both caches",
        f"wall {res['wall_s']:.0f} s",
    ]
    return "\n".join(lines)
