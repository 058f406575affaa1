"""The text table and the plot of `benchmarks/transfer.py`'s results (no Ray, no NIXL)."""

from __future__ import annotations

import statistics

from serving.bench.provenance import header_line


def median(xs):
    return statistics.median(xs) if xs else float("nan")


LAYOUT_NOTES = {
    "HND": "K and V planes per layer (flash-attention style): 60 regions, 12 KiB per block",
    "NHD": "K and V planes per layer, token-major: 60 regions, 12 KiB per block",
    "HCND": "K/V packed per block (vLLM's CPU backend, what raypd serves here): 30 regions, 24 KiB per block",
}


def verify_lines(part: dict) -> list[str]:
    """The transfer.verify table of one layout: what checksums cost the producer (hold) and the reader."""
    rows = part.get("verify_rows") or []
    if not rows:
        return []
    off = {r["tokens"]: r["pull_s"] for r in rows if r["verify"] == "off"}
    hdr = (f"{'tokens':>6} {'verify':<7} {'blocks':>6} {'pull ms':>8} {'confirm':>7} {'check ms':>8} "
           f"{'hold ms':>8} {'pull vs off':>11}")
    out = ["", f"transfer.verify ({part['layout']}, {rows[0]['pattern']} blocks): hold = the producer's lease grant "
           "(+ its checksums); check = the reader's recomputation; blocks = blocks checked", hdr, "-" * len(hdr)]
    for r in rows:
        base = off.get(r["tokens"])
        vs = f"{(r['pull_s'] / base - 1) * 100:>+10.0f}%" if base else f"{'-':>11}"
        out.append(f"{r['tokens']:>6} {r['verify']:<7} {r['checked_blocks']:>6} {r['pull_s'] * 1e3:>8.2f} "
                   f"{r['confirm_s'] * 1e3:>7.2f} {r['verify_s'] * 1e3:>8.2f} {r['hold_s'] * 1e3:>8.2f} {vs}")
    return out


def table(res: dict) -> str:
    s, h = res["shape"], res["host"]
    lines = [
        f"# {res['date']}",
        f"# command: {res['command']}",
        header_line(res.get("git", {})),
        f"# host: {h['cpus']} CPUs, load average {h['loadavg_before'][0]:.2f} before / "
        f"{h['loadavg_after'][0]:.2f} after (1 min; shared machine)",
        f"KV pull as raypd runs it (RankTransfer over NIXL/UCX, two Ray actors, loopback) vs in-process gather"
        f" -- {s['layers']} layers x {s['kv_heads']} kv heads x {s['head_size']}, block {s['block_size']},"
        f" {s['dtype']}; medians of {res['settings']['reps']} reps",
    ]
    mib = 2**20
    for part in res["layouts"]:
        layout = part["layout"]
        lines += ["", f"layout {layout}: {LAYOUT_NOTES.get(layout, '')}"]
        hdr = (f"{'tokens':>6} {'pattern':<10} {'MiB':>6} {'descs':>6} {'spans':>6} {'pull ms':>8} {'(start':>7} "
               f"{'confirm':>7} {'gather ms':>9} {'pull GB/s':>9} {'gather GB/s':>11} {'pull/gather':>11}")
        lines += [hdr, "-" * len(hdr)]
        for r in part["rows"]:
            lines.append(f"{r['tokens']:>6} {r['pattern']:<10} {r['bytes'] / mib:>6.1f} {r['descriptors']:>6} "
                         f"{r.get('spans', r['descriptors']):>6} "
                         f"{r['pull_s'] * 1e3:>8.2f} {r['start_pull_s'] * 1e3:>7.2f} "
                         f"{r.get('confirm_s', float('nan')) * 1e3:>7.2f} {r['gather_s'] * 1e3:>9.2f} "
                         f"{r['pull_gbps']:>9.2f} {r['gather_gbps']:>11.2f} {r['ratio_pull_over_gather']:>11.2f}")
        for r in part["rows"]:
            if r["tokens"] in (4096, 8192):
                verdict = "meets" if r["ratio_pull_over_gather"] >= 0.8 else "BELOW"
                lines.append(f"goal ({layout}, {r['tokens']} tokens, {r['pattern']}): pull/gather = "
                             f"{r['ratio_pull_over_gather']:.2f} -> {verdict} the 0.8 goal")
        lines += verify_lines(part)
        hs = part["first_handshake"]
        if hs:
            later = [x["total_s"] for x in hs[1:]]
            worst = max(x["total_s"] / x["peer_ranks"] for x in hs)
            lines.append(f"first handshake ({layout}; fetch payload over Ray + add peer + connect + prepare lists), "
                         f"1 peer rank: first in process {hs[0]['total_s'] * 1e3:.1f} ms (fetch "
                         f"{hs[0]['fetch_s'] * 1e3:.1f}), later median {median(later) * 1e3:.1f} ms of {len(later)} -> "
                         f"{'meets' if worst <= 0.050 else 'BELOW'} the 50 ms per peer rank goal "
                         f"(worst {worst * 1e3:.1f} ms)")
        idle = part["idle_agent"]
        lines.append(f"idle agent ({layout}; producer, nothing held, no pump): its {idle['threads']} threads used "
                     f"{idle['cpu_s'] * 1e3:.0f} ms CPU in {idle['wall_s']:.1f} s = {idle['core_pct']:.2f} % of a core")
        lines.append(f"huge pages (2 MiB) under the data: producer KV {part['producer']['huge_page_bytes'] // mib} MiB,"
                     f" consumer KV {part['consumer']['huge_page_bytes'] // mib} MiB, baseline source "
                     f"{part['consumer']['baseline_src_huge_page_bytes'] // mib} MiB")
    lines += [
        "",
        "pull = RankTransfer.start_pull -> step() until done (plan lookup + vectorised id checks + descriptor",
        "  indices + NIXL post, in which UCX's CMA copy runs, + completion + layout post-processing); start =",
        "  start_pull alone; confirm = data READs done -> every source's lease record READ back HELD (the",
        "  fail-closed check: a small READ round trip, in the same step when it lands at once); gather =",
        "  index_select + index_copy_ of the same blocks for every (layer, plane)",
        "  tensor in the consumer; descs = descriptors posted; spans = extents once NIXL merged the pairs",
        "  adjacent in both caches (raypd sorts each READ by local block so such runs line up ascending);",
        "  on one host each extent is one process_vm_readv call (~2.5 us kernel overhead + the copy)",
        f"wall {res['wall_s']:.0f} s",
    ]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = [r for part in res["layouts"] for r in part["rows"]]
    patterns = sorted({r["pattern"] for r in all_rows})
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 4), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        for part in res["layouts"]:
            rows = [r for r in part["rows"] if r["pattern"] == pattern]
            xs = [r["tokens"] for r in rows]
            ax.plot(xs, [r["pull_gbps"] for r in rows], marker="o", label=f"raypd pull, {part['layout']}")
            ax.plot(xs, [r["gather_gbps"] for r in rows], marker="s", linestyle="--",
                    label=f"in-process gather, {part['layout']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"{pattern} blocks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV pull, 30 layers x 3 heads x 64, block 16, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
