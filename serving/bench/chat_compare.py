"""`raypd bench --workload chat --compare-routing CONFIG`: cache-aware routing + conditional P/D, on vs off.

Starts its own local Ray cluster and CONFIG's engines (e.g. configs/local.yaml:
SmolLM2, 1 prefill + 1 decode, prefix caching on, KV events on), then two
fronts under uvicorn in child processes, attached to the same engines, that
differ only in their router settings:

  off  router.policy least_outstanding, placement disaggregate: every prompt is
       prefilled on a prefill engine, by load alone;
  on   router.policy cache_aware, placement slo: each request colocated or
       disaggregated by the SLO model, counting each engine's cached prefix.

For each concurrency level the chat workload (serving.bench.chat) runs through
`off`, then through `on`, with different seeds (the same shape of conversations,
other texts: one variant never finds the other's prompts in the engines' prefix
caches). Printed and written to `--chat-results` (JSON + .txt): TTFT p50/p90 of
all turns and of later turns, the fraction of prompt tokens served from prefix
caches (usage.prompt_tokens_details.cached_tokens), each front's prefill
decisions (raypd_disagg_decisions_total) and the on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from serving.bench.samples import free_port, host_state, write_results
from serving.bench.chat import ChatLevelResult, run_chat_load

VARIANTS = ("off", "on")


def variant_router(variant: str, args: argparse.Namespace) -> dict:
    if variant == "off":
        return {"policy": "least_outstanding", "placement": "disaggregate"}
    return {"policy": "cache_aware", "placement": "slo"}


def decisions_of(metrics_text: str) -> dict[str, float]:
    """`decision/reason` -> count, from a front's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "raypd_disagg_decisions":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[f"{s.labels['decision']}/{s.labels['reason']}"] = s.value
    return out


def table(results: dict[str, list[ChatLevelResult]], decisions: dict[str, dict]) -> str:
    lines = [f"{'':<34}" + "".join(f"{v:>12}" for v in VARIANTS) + f"{'on/off':>10}"]
    for i, off in enumerate(results["off"]):
        on = results["on"][i]
        lines.append(f"concurrency {off.level.concurrency}: {off.turns} / {on.turns} turns, "
                     f"{off.level.errors} / {on.level.errors} errors")
        rows = [("TTFT p50 ms (all turns)", off.level.ttft_ms["p50"], on.level.ttft_ms["p50"]),
                ("TTFT p90 ms (all turns)", off.level.ttft_ms["p90"], on.level.ttft_ms["p90"]),
                ("TTFT p50 ms (later turns)", off.ttft_later_turns_ms["p50"], on.ttft_later_turns_ms["p50"]),
                ("TTFT p90 ms (later turns)", off.ttft_later_turns_ms["p90"], on.ttft_later_turns_ms["p90"]),
                ("TTFT p50 ms (first turns)", off.ttft_first_turn_ms["p50"], on.ttft_first_turn_ms["p50"]),
                ("ITL p50 ms", off.level.itl_ms["p50"], on.level.itl_ms["p50"]),
                ("e2e p50 ms", off.level.e2e_ms["p50"], on.level.e2e_ms["p50"])]
        for name, a, b in rows:
            lines.append(f"  {name:<32}{a:>12.1f}{b:>12.1f}{b / a if a else float('nan'):>10.2f}")
        fa, fb = off.cached_fraction, on.cached_fraction
        lines.append(f"  {'prompt tokens from cache':<32}{_pct(fa):>12}{_pct(fb):>12}")
    for v in VARIANTS:
        lines.append(f"prefill decisions ({v}): " + (" ".join(f"{k}={n:.0f}" for k, n in sorted(
            decisions[v].items())) or "none"))
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def run_compare(args: argparse.Namespace) -> int:
    import httpx
    import ray


    from serving.config import DeploymentConfig, load_config
    from serving.ops.health_probe import wait_healthy
    from serving.cluster.ray_init import init_ray
    from serving.cluster.launcher import launch, shutdown_deployment

    base = load_config(args.compare_routing).model_dump(mode="json")
    base["name"] = "raypd-bench-chat"
    base["router"].update(variant_router("on", args))  # the engines publish KV events (cache-aware)
    cfg = DeploymentConfig.from_dict(base)
    started = init_ray(cfg, None, temp_dir="/tmp/raypd-bench-ray")
    children: list[subprocess.Popen] = []
    try:
        print(f"starting {cfg.prefill.count}P+{cfg.decode.count}D {cfg.model} engines...", flush=True)
        launch(cfg)
        fronts: dict[str, str] = {}
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        for variant in VARIANTS:
            data = json.loads(json.dumps(base))
            data["router"].update(variant_router(variant, args))
            port = free_port()
            children.append(subprocess.Popen(
                [sys.executable, "-m", "serving.bench.overhead", "--uvicorn-front", json.dumps(data), str(port),
                 ray.get_runtime_context().gcs_address], env=env))
            fronts[variant] = f"http://127.0.0.1:{port}"
        for proc, url in zip(children, fronts.values()):
            wait_healthy(url, 300, proc)
        before = host_state()
        results: dict[str, list[ChatLevelResult]] = {}
        for k, variant in enumerate(VARIANTS):
            print(f"--- {variant}: {variant_router(variant, args)}", flush=True)
            results[variant] = asyncio.run(run_chat_load(args, fronts[variant], seed=args.seed + 1000 * k))
        decisions = {v: decisions_of(httpx.get(url + "/metrics", timeout=10).text) for v, url in fronts.items()}
        text = table(results, decisions)
        print("\n" + text, flush=True)
        if args.chat_results:
            write(args.chat_results, args, cfg, results, decisions, before, text)
        return 0 if all(r.level.errors == 0 for rs in results.values() for r in rs) else 1
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutdown_deployment(cfg.name)
        if started:
            ray.shutdown()


def write(path: str, args: argparse.Namespace, cfg: Any, results: dict, decisions: dict, before: dict,
          text: str) -> None:


    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    after = host_state()
    out = {
        "command": "raypd bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {**before, "loadavg_after": after["loadavg"]},
        "deployment": {"model": cfg.model, "prefill": cfg.prefill.count, "decode": cfg.decode.count,
                       "max_model_len": cfg.max_model_len},
        "workload": {k: getattr(args, k) for k in ("concurrency", "conversations", "turns", "system_prompts",
                                                   "system_len", "user_len", "output_len", "seed")},
        "variants": {v: {"router": variant_router(v, args), "levels": [asdict(r) for r in results[v]],
                         "decisions": decisions[v]} for v in VARIANTS},
    }
    write_results(path, out, text)

