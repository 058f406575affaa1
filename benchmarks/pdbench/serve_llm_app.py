#!/usr/bin/env python
"""Set-up (d): Ray Serve LLM's own apps, as shipped, on this CPU box (a child process of the benchmark).

  python benchmarks/pdbench/serve_llm_app.py --mode pd|colocated --model DIR --port P --temp-dir DIR \
      --settings JSON

`pd`: `build_pd_openai_app({"prefill_config": p, "decode_config": d})`, both
`LLMConfig`s with vLLM's NixlConnector (kv_both). `colocated`: its twin,
`build_openai_app({"llm_configs": [c]})`, no connector. What makes Serve LLM run
on CPU (facts in shared/notes/ray-serve-llm-on-cpu.md): a placement group with
one CPU-only bundle per engine (Serve LLM then uses vLLM's mp executor) and,
per engine, `runtime_env` env vars `VLLM_CPU_OMP_THREADS_BIND` (its core: "0"
prefill/colocated, "1" decode) and `VLLM_CPU_KVCACHE_SPACE`. Everything else is
Serve LLM's defaults (its ingress, its P/D proxy, 50 ms stream batching).

Starts its own Ray cluster, prints `READY` when the app is deployed, and on
SIGTERM deletes the app, shuts Serve and Ray down and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def llm_config(args: argparse.Namespace, settings: dict, core: str, nixl: bool):
    from ray.serve.llm import LLMConfig

    engine_kwargs = {
        "dtype": settings["dtype"], "enforce_eager": True, "max_model_len": settings["max_model_len"],
        "block_size": settings["block_size"], "enable_prefix_caching": settings["enable_prefix_caching"],
        "max_num_seqs": settings["max_num_seqs"], "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "seed": 0,
    }
    if nixl:
        engine_kwargs["kv_transfer_config"] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    return LLMConfig(
        model_loading_config={"model_id": settings["served_model_name"], "model_source": args.model},
        engine_kwargs=engine_kwargs,
        placement_group_config={"bundles": [{"CPU": 1}]},
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": core,
                                  "VLLM_CPU_KVCACHE_SPACE": str(settings["kv_cache_gib"]),
                                  "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}},
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["pd", "colocated"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--settings", required=True, help="JSON: dtype, max_model_len, block_size, ...")
    args = p.parse_args()
    settings = json.loads(args.settings)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app, build_pd_openai_app

    # Logical CPUs only: each Serve LLM engine replica asks for 2 (replica + engine bundle), the
    # ingress for 1; physical cores are assigned by VLLM_CPU_OMP_THREADS_BIND.
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=args.temp_dir, log_to_driver=False)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # Ray's core worker installed its own
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        if args.mode == "pd":
            app = build_pd_openai_app({"prefill_config": llm_config(args, settings, "0", True),
                                       "decode_config": llm_config(args, settings, "1", True)})
        else:
            app = build_openai_app({"llm_configs": [llm_config(args, settings, "0", False)]})
        serve.run(app, name="bench", route_prefix="/", blocking=False)
        print("READY", flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        try:
            serve.shutdown()
        except Exception as exc:  # noqa: BLE001 - keep stopping
            print(f"serve shutdown: {exc!r}", file=sys.stderr)
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


if __name__ == "__main__":
    sys.exit(main())
