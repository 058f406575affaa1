"""`raypd bench`: its arguments and which mode runs (random load, chat workload, routing comparison, overhead)."""

from __future__ import annotations

import argparse

from serving.bench.chat import add_chat_arguments, run_chat
from serving.bench.chat_compare import run_compare
from serving.bench.load import run_random
from serving.bench.overhead import run_overhead


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="Bearer key when the server requires one")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO: time to first token")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput SLO: mean inter-token latency")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")
    p.add_argument("--overhead", action="store_true",
                   help="measure the front's own overhead against direct actor calls (synthetic backend)")
    p.add_argument("--config", default="configs/synthetic.yaml", help="--overhead: the synthetic deployment")
    p.add_argument("--overhead-concurrency", type=int, default=16, help="--overhead: concurrency of the rps runs")
    p.add_argument("--results", default="benchmarks/results/front_overhead.json",
                   help="--overhead: write the results here (JSON, and the printed table as .txt); '' for none")
    add_chat_arguments(p)


# ------------------------------------------------------------------ HTTP load


def run(args: argparse.Namespace) -> int:
    if args.overhead:
        return run_overhead(args)
    if args.workload == "chat":
        return run_compare(args) if args.compare_routing else run_chat(args)
    return run_random(args)
