"""The plot of a pd_vs_vllm run (from its summary): low-load TTFT / first gap / ITL, load goodput / ITL / TTFT."""

from __future__ import annotations

from pdbench.summary import NAMES, ORDER


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sm = res["summary"]
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    for s in ORDER:
        low = sm["low"].get(s)
        if low:
            xs = sorted(low)
            ax[0][0].plot(xs, [low[n]["ttft_p50"] * 1e3 for n in xs], marker="o", label=NAMES[s])
            ax[0][1].plot(xs, [low[n]["tok12_p90"] * 1e3 for n in xs], marker="o", label=NAMES[s])
            ax[0][2].plot(xs, [low[n]["itl_p50"] * 1e3 for n in xs], marker="o", label=NAMES[s])
        load = sm["load"].get(s)
        if load:
            rs = sorted(load)
            ax[1][0].plot(rs, [load[r]["goodput_rps"] for r in rs], marker="o", label=NAMES[s])
            ax[1][1].plot(rs, [load[r]["itl_p99"] * 1e3 for r in rs], marker="o", label=NAMES[s])
            ax[1][2].plot(rs, [load[r]["ttft_p90"] * 1e3 for r in rs], marker="o", label=NAMES[s])
    titles = [["low load: TTFT p50 (ms)", "low load: 1st->2nd token gap p90 (ms)", "low load: ITL p50 (ms)"],
              ["load: goodput (requests/s meeting the SLO)", "load: ITL p99 (ms)", "load: TTFT p90 (ms)"]]
    for i in range(2):
        for j in range(3):
            a = ax[i][j]
            a.set_title(titles[i][j], fontsize=10)
            a.grid(True, alpha=0.3)
            a.legend(fontsize=7)
            if i == 0:
                a.set_xscale("log", base=2)
                a.set_xlabel("prompt tokens")
            else:
                a.set_xlabel("Poisson arrival rate (requests/s)")
    ax[0][0].set_yscale("log")
    ax[1][2].set_yscale("log")
    fig.suptitle(f"SmolLM2-135M fp32, 2 cores, one core per engine: {res['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
