"""A multi-node Ray cluster on loopback (ray.cluster_utils.Cluster): prefill on node A, decode on
node B, coordinator on the head. Run as a script (it owns its cluster); prints one JSON line.

    python tests/integration/multinode_scenario.py synthetic|vllm
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from service_helpers import UvicornThread, free_port  # noqa: E402

from serving.front import create_app, served_model_of  # noqa: E402
from serving.config import DeploymentConfig  # noqa: E402
from serving.cluster.launcher import launch, shutdown_deployment  # noqa: E402
from serving.cluster.clients import build_router  # noqa: E402


def deployment(backend: str) -> DeploymentConfig:
    common = {"name": f"mn-{backend}", "transfer": {"failure_policy": "fail", "lease_ttl_s": 20},
              "router": {"placement": "disaggregate"}}  # the P/D path across nodes, not a colocated answer
    if backend == "synthetic":
        return DeploymentConfig.from_dict({
            **common, "backend": "synthetic",
            "synthetic": {"model_id": "mn-synth", "num_layers": 2, "num_kv_heads": 2, "head_size": 32},
            "prefill": {"count": 1, "tp_size": 2, "block_size": 16, "num_blocks": 256, "num_cpus": 0,
                        "resources": {"prefill": 1}},
            "decode": {"count": 1, "tp_size": 1, "block_size": 32, "num_blocks": 256, "num_cpus": 0,
                       "resources": {"decode": 1}},
        })
    return DeploymentConfig.from_dict({
        **common, "backend": "vllm", "model": "smollm2", "max_model_len": 512, "dtype": "float32",
        "engine_kwargs": {"enforce_eager": True},
        "prefill": {"count": 1, "num_cpus": 0, "resources": {"prefill": 1}, "cpu_bind": ["0"]},
        "decode": {"count": 1, "num_cpus": 0, "resources": {"decode": 1}, "cpu_bind": ["1"]},
    })


def scale_up(cfg: DeploymentConfig, cluster: Cluster) -> dict:
    """The autoscaler's way to add an engine respects the pool's node resources: a second prefill
    engine has no node until one with `prefill: 1` joins, and an unplaceable attempt leaves nothing."""
    import asyncio

    from serving.cluster.engines import Unschedulable, start_engine

    out: dict = {}
    try:
        asyncio.run(start_engine(cfg, "prefill", 1, timeout_s=120, place_timeout_s=3))
        out["scale_unschedulable"] = False
    except Unschedulable:
        out["scale_unschedulable"] = True
    out["scale_pg_left_after_refusal"] = [
        i["name"] for i in ray.util.placement_group_table().values()
        if i.get("state") != "REMOVED" and (i.get("name") or "").endswith("prefill-1-pg")]
    node_c = cluster.add_node(num_cpus=1, resources={"prefill": 1})
    handle = asyncio.run(start_engine(cfg, "prefill", 1, timeout_s=120, place_timeout_s=60))
    out["scaled_prefill_on_c"] = ray.get(handle.placement.remote())["node_id"] == node_c.node_id
    return out


def main(backend: str) -> int:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    node_a = cluster.add_node(num_cpus=1, resources={"prefill": 1})
    node_b = cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, namespace="raypd", log_to_driver=False)
    result: dict = {"backend": backend}
    try:
        cfg = deployment(backend)
        dep = launch(cfg)
        (p,), (d,) = dep.prefills.values(), dep.decodes.values()
        p_place, d_place = ray.get([p.placement.remote(), d.placement.remote()])
        head_id = ray.get_runtime_context().get_node_id()
        result.update(
            prefill_on_a=p_place["node_id"] == node_a.node_id,
            decode_on_b=d_place["node_id"] == node_b.node_id,
            prefill_ranks_on_a=all(n == node_a.node_id for n in p_place["rank_nodes"]),
            decode_ranks_on_b=all(n == node_b.node_id for n in d_place["rank_nodes"]),
            coordinator_on_head=ray.get(dep.coordinator.node_id.remote()) == head_id,
            prefill_ranks=len(p_place["rank_nodes"]),
        )
        port = free_port()
        router = build_router(cfg, dep)
        with UvicornThread(create_app(cfg, router, served_model_of(dep)), port):
            model = cfg.served_model_name
            body = ({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                     "max_tokens": 16, "temperature": 0})
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
            result["status"] = r.status_code
            result["text"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
            stats = ray.get(d.stats.remote())
            result["decode_pulls"] = stats.backend.counters.get("kv_pulls")
            result["recomputed"] = stats.recomputed
            # the P/D path, not the decode-local fallback: the prefill engine ran the prompt, the
            # decode engine continued, and no transfer failed
            result["prefill_requests"] = ray.get(p.stats.remote()).requests
            result["fallbacks"] = dict(router.pool.fallbacks)
            result["transfer_failures"] = sum(router.pool.transfer_failures.values())
        if backend == "synthetic":
            result.update(scale_up(cfg, cluster))
        shutdown_deployment(cfg.name)
        time.sleep(1)
        result["placement_groups_left"] = [
            i["name"] for i in ray.util.placement_group_table().values()
            if i.get("state") != "REMOVED" and (i.get("name") or "").startswith("raypd-")]
    finally:
        print(json.dumps(result), flush=True)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "synthetic"))
