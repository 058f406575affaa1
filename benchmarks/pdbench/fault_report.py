"""The text table and the plot of benchmarks/faults.py, printed from its results JSON alone."""

from __future__ import annotations

from serving.bench.provenance import header_line

NAMES = {"b": "(b) raypd 1P+1D", "e": "(e) raypd default (2x both, slo)", "c": "(c) vLLM NixlConnector P/D + proxy"}
NOT_MEASURED = (
    "NOT MEASURED\n"
    "  (d) Ray Serve LLM P/D: not run under faults. In benchmarks/results/pd_vs_vllm_anchors.txt it completed\n"
    "      1 of 20 requests at 0.3 req/s (after 63 s) and 0 of 20 at 0.6 and 0.9, healthy: there is no\n"
    "      goodput to lose, so it is not measured under faults.\n")
NO_PARTITION = ("  P<->D partition: not run (--partition-s 0, or not root: the hosts are network namespaces).\n")
NOTES = (
    "NOTES\n"
    "  right = HTTP 200, [DONE], no error event, text equal to the set-up's own batch-1 greedy reference\n"
    "  (computed on the healthy set-up before its fault phases); wrong = the same but a different text.\n"
    "  CPU kernels are not batch-invariant: a mismatch at a near tie is possible under load. tie = a\n"
    "  mismatch whose first differing token is at a near tie (<= 0.05 nats between the reference's top\n"
    "  two; raypd refuses `logprobs`, so the gap is computed after the run with the model in\n"
    "  transformers, float32: an estimate, pdbench/fault_ties.py). Ties count in goodput, not in `right`.\n"
    "  cut = ended without [DONE] and without an error event, or the transport failed (before a response\n"
    "  included); hung = no outcome within the request limit; error = HTTP error status or error event.\n"
    "  goodput = right answers (near ties too) completed per second: before the fault, during its window\n"
    "  (SIGSTOP: until SIGCONT; SIGKILL: a fixed window after the kill; partition: until healed), after it\n"
    "  (to the last outcome).\n"
    "  first good = fault -> first right answer of a request sent at or after the fault.\n"
    "  raypd: a killed engine is restarted by Ray/raypd (recovery = engine cores back + /health 200).\n"
    "  (c): nothing restarts a killed server (the set-up's own behaviour); the harness restarts the whole\n"
    "  set-up before its next phase. Same prompts (hence prefix-cache hits on the reference's blocks) in\n"
    "  every phase and set-up.\n"
    "  P<->D partition (hosts): the set-up started again on three network-namespace hosts of this machine\n"
    "  (benchmarks/hostnet: a bridge, UCX on TCP over each host's link, same engine cores), its own batch-1\n"
    "  references computed there, then the prefill host and the decode host cut from each other (the\n"
    "  bridge drops their frames; both still reach the front's host); raypd's Ray nodes run on the hosts.\n")


def header(res: dict) -> str:
    h = res["host"]
    return (f"# faults.py {res['date']}\n# command: {res['command']}\n" + header_line(res["git"]) + "\n"
            f"# host: {h['cpus']} CPUs; load average before {h['before']}, after {h.get('after')}; "
            f"wall {res.get('wall_s')} s" + (f"; ABORTED: {res['aborted']}" if res.get("aborted") else "") + "\n"
            f"# load: {res['settings']['requests']} requests per phase, open loop at {res['settings']['rate']} req/s, "
            f"{res['settings']['prompt_tokens']}-token prompts, {res['settings']['max_tokens']}-token answers, "
            f"fault at {res['settings']['fault_at_s']} s, request limit {res['settings']['limit_s']} s\n")


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(res: dict) -> str:
    lines = ["UNDER FAULTS (goodput in right answers/s: before | during | after the fault window)",
             f"  {'set-up':36} {'fault':24} {'sent':>4} {'right':>5} {'wrong':>5} {'tie':>3} {'cut':>4} {'hung':>4} "
             f"{'err':>4} {'wrong%':>6} {'goodput b|d|a':>17} {'1st good s':>10} {'kills':>5} {'misses':>6}"]
    for setup, phases in res.get("figures", {}).items():
        for phase, f in phases.items():
            c = f["counts"]
            fc = res.get("fault_counts", {}).get(setup, {}).get(phase, {})
            kills = "-" if not fc else f"{fc.get('hang_kills', 0):.0f}"
            misses = "-" if not fc else f"{fc.get('deadline_misses', 0):.0f}"
            gp = f"{_g(f['goodput_before'])}|{_g(f['goodput_during'])}|{_g(f['goodput_after'])}"
            lines.append(f"  {NAMES.get(setup, setup):36} {phase:24} {f['sent']:>4} {c['right']:>5} {c['wrong']:>5} "
                         f"{c.get('tie', 0):>3} {c['cut']:>4} {c['hung']:>4} {c['error']:>4} "
                         f"{100 * f['wrong_rate']:>5.0f}% {gp:>17} "
                         f"{_g(f['first_good_s']):>10} {kills:>5} {misses:>6}")
            for kind, ds in f.get("details", {}).items():
                if kind != "right":
                    lines.append(f"      {kind}: {'; '.join(ds)}")
            info = res.get("phase_info", {}).get(setup, {}).get(phase, {})
            if info:
                lines.append(f"      {info_line(info)}")
    lines.append("")
    lines.append("REFERENCES (batch 1, healthy): " + "; ".join(
        f"{NAMES.get(s, s)}: {r}" for s, r in res.get("reference_summary", {}).items()))
    lines.append("FALSE KILLS (raypd: hang kills in phases that stopped no engine): "
                 + ("; ".join(res.get("false_kills", [])) or "-"))
    lines.append("CHECK (raypd: no wrong answer, cut stream or hung request): "
                 + ("; ".join(res.get("check", [])) or "passed"))
    partitioned = any("partition" in p for ps in res.get("figures", {}).values() for p in ps)
    return "\n".join(lines) + "\n\n" + NOT_MEASURED + ("" if partitioned else NO_PARTITION) + "\n" + NOTES


def info_line(info: dict) -> str:
    if info.get("partition_s") is not None:
        parts = [f"hosts 1 and 2 cut from each other for {info['partition_s']} s"]
    else:
        parts = [f"signalled {info.get('signalled')}"]
    if info.get("recovered_s") is not None or "recovered_s" in info:
        parts.append(f"recovered after {info.get('recovered_s')} s")
    if info.get("hosts_startup_s") is not None:
        parts.append(f"across hosts up in {info['hosts_startup_s']} s, references {info.get('references')} "
                     f"(the decode host's link received {info.get('decode_host_rx_mb')} MB meanwhile)")
    if info.get("restarted_setup_s") is not None:
        parts.append(f"set-up restarted by the harness in {info['restarted_setup_s']} s")
    if info.get("placement"):
        parts.append(f"placement {info['placement']}")
    if info.get("at_rest"):
        if "at_rest_after_s" in info:
            held = ("nothing held" if info["at_rest_after_s"] is not None else "STILL HELD") + \
                f" {info['at_rest_after_s']} s after recovery"
            parts.append(f"at rest ({held}) {info['at_rest']}")
        else:
            parts.append(f"at rest {info['at_rest']}")
    return ", ".join(parts)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(s, p, f) for s, ps in res.get("figures", {}).items() for p, f in ps.items()]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{s}: {p}" for s, p, _ in rows]
    x = range(len(rows))
    for k, (key, name) in enumerate((("goodput_before", "before"), ("goodput_during", "during"),
                                     ("goodput_after", "after"))):
        ax[0].bar([i + 0.27 * (k - 1) for i in x], [f[key] for _, _, f in rows], 0.27, label=name)
    ax[0].set_ylabel("goodput (right answers/s)")
    ax[1].bar(list(x), [100 * f["wrong_rate"] for _, _, f in rows], color="crimson")
    ax[1].set_ylabel("wrong answers (% of 200 answers)")
    for a in ax:
        a.set_xticks(list(x))
        a.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
