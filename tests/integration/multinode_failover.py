"""A node dies under load (issue 21): a simulated Ray cluster (`ray.cluster_utils.Cluster`), synthetic engines
spread over nodes labelled by role, a few hundred requests through the real front. Run as a script (it owns
its cluster); prints one JSON line.

    python tests/integration/multinode_failover.py

Life cycle of the run:

  1. nodes: the head (the coordinator), `P` (resource prefill: 2), `Da` and `Db` (decode: 1 each), as the
     KubeRay manifests label worker groups; the deployment's two prefill engines land on `P`, one decode
     engine on each decode node (one STRICT_PACK placement group per engine, ranks inside it);
  2. reference: every prompt once, uninterrupted: the synthetic engine's tokens follow from the prompt,
     so these answers are what every later answer must equal;
  3. failover: the same prompts again, `CONCURRENCY` at a time; once a third of them answered, the raylet
     of the node under decode engine 0 is killed (`remove_node(allow_graceful=False)`): streams on it
     migrate to the other decode engine or end with a clean error event; `/health` must name the one
     decode engine left (the pool shrank, and says so);
  4. replacement: the launcher's node-loss watch removes the dead engine's placement group and kills its
     actor for good, then starts the engine again as a new group and actor (`serving.cluster.node_loss`);
     a spare node with the decode resource joins, the new group lands there and the engine registers as a
     new incarnation (looked up again by name: the old handle died with its actor); more requests go
     through, some on it;
  5. nothing stranded: every engine's free blocks back to its baseline and no lease held; after shutdown,
     no placement group of the deployment left.

Every answer is classified: equal to its reference, failed cleanly (an error event, then [DONE]),
different (a wrong answer) or cut (the connection ended without [DONE]); the last two must never happen.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections import Counter

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from service_helpers import UvicornThread, engine_stats, free_port, wait_blocks_at_baseline  # noqa: E402

from serving.cluster.clients import build_router  # noqa: E402
from serving.cluster.launcher import find_launcher, launch, shutdown_deployment  # noqa: E402
from serving.cluster.names import NAMESPACE, actor_name_of  # noqa: E402
from serving.config import DeploymentConfig  # noqa: E402
from serving.front import create_app, served_model_of  # noqa: E402

NAME = "mnf"
PROMPTS = 200
FINAL = 40
CONCURRENCY = 8
MAX_TOKENS = 12


def deployment() -> DeploymentConfig:
    return DeploymentConfig.from_dict({
        "name": NAME, "backend": "synthetic", "max_model_len": 1024,
        "synthetic": {"model_id": "mnf-synth", "num_layers": 2, "num_kv_heads": 2, "head_size": 32,
                      "token_latency_s": 0.02},
        "prefill": {"count": 2, "tp_size": 1, "block_size": 16, "num_blocks": 256, "num_cpus": 0,
                    "resources": {"prefill": 1}},
        "decode": {"count": 2, "tp_size": 1, "block_size": 16, "num_blocks": 256, "num_cpus": 0,
                   "resources": {"decode": 1}},
        "transfer": {"failure_policy": "fail", "lease_ttl_s": 10, "read_timeout_s": 5},
        "router": {"migration_wait_s": 20},
    })


def prompt(i: int) -> str:
    return f"request {i}: tell me about the number {i * 7919 % 1000} and its neighbours " * 3


async def ask(client: httpx.AsyncClient, url: str, model: str, i: int) -> dict:
    """One streamed completion: its text, finish reason, and how the stream ended."""
    body = {"model": model, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finish, error, done = "", None, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"i": i, "status": r.status_code, "error": (await r.aread()).decode()[:200], "done": True}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"].get("message", "error")
                    continue
                choice = event["choices"][0] if event.get("choices") else {}
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        return {"i": i, "status": 200, "cut": f"{type(exc).__name__}: {exc}", "done": False, "text": text}
    return {"i": i, "status": 200, "text": text, "finish": finish, "error": error, "done": done}


async def run_all(url: str, model: str, indices: list[int], on_progress=None) -> list[dict]:
    sem = asyncio.Semaphore(CONCURRENCY)
    done: list[dict] = []
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            async with sem:
                done.append(await ask(client, url, model, i))
                if on_progress is not None:
                    on_progress(len(done))

        await asyncio.gather(*(one(i) for i in indices))
    return sorted(done, key=lambda a: a["i"])


def classify(answers: list[dict], reference: dict[int, dict]) -> Counter:
    out: Counter = Counter()
    for a in answers:
        if not a["done"]:
            out["cut"] += 1
        elif a.get("error") or a["status"] != 200:
            out["failed_clean"] += 1
        elif (a["text"], a["finish"]) == (reference[a["i"]]["text"], reference[a["i"]]["finish"]):
            out["equal"] += 1
        else:
            out["different"] += 1
    return out


def main() -> int:
    t_start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    node_p = cluster.add_node(num_cpus=1, resources={"prefill": 2})
    decode_nodes = [cluster.add_node(num_cpus=1, resources={"decode": 1}) for _ in range(2)]
    ray.init(address=cluster.address, namespace="raypd", log_to_driver=False)
    result: dict = {}
    cfg = deployment()
    try:
        dep = launch(cfg)
        d0_id = f"{NAME}-decode-0"
        d0 = dep.decodes[d0_id]
        places = {eid: ray.get(h.placement.remote()) for eid, h in dep.engines.items()}
        node_of = {n.node_id: name for name, n in [("P", node_p), ("Da", decode_nodes[0]), ("Db", decode_nodes[1])]}
        result["placed"] = {eid: node_of.get(p["node_id"], "head") for eid, p in places.items()}
        result["ranks_follow"] = all(set(p["rank_nodes"]) == {p["node_id"]} for p in places.values())
        victim = next(n for n in decode_nodes if n.node_id == places[d0_id]["node_id"])
        baseline = engine_stats(dep)
        router = build_router(cfg, dep)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with UvicornThread(create_app(cfg, router, served_model_of(dep)), port):
            model = cfg.served_model_name
            reference = {a["i"]: a for a in asyncio.run(run_all(url, model, list(range(PROMPTS))))}
            result["reference"] = dict(Counter("ok" if a["done"] and not a.get("error") else "bad"
                                               for a in reference.values()))

            killed = threading.Event()

            def kill_at(n: int) -> None:
                if n >= PROMPTS // 3 and not killed.is_set():
                    killed.set()
                    threading.Thread(target=cluster.remove_node, args=(victim,),
                                     kwargs={"allow_graceful": False}, daemon=True).start()

            t_kill = time.monotonic()
            failover = asyncio.run(run_all(url, model, list(range(PROMPTS)), on_progress=kill_at))
            result["failover"] = dict(classify(failover, reference))
            result["failover_errors"] = sorted({a.get("error") or a.get("cut") or "" for a in failover} - {""})[:5]
            result["migrations"] = dict(router.pool.migrations)
            health = httpx.get(f"{url}/health", timeout=30).json()  # the pool shrank, and says so
            result["decodes_after_kill"] = list(health.get("decode_engines", ()))
            result["failover_s"] = round(time.monotonic() - t_kill, 1)

            before = {e.engine_id: e.generation for e in ray.get(dep.coordinator.engines.remote())}
            spare = cluster.add_node(num_cpus=1, resources={"decode": 1})  # the replacement node joins
            deadline, back = time.monotonic() + 120, None
            while time.monotonic() < deadline:
                now = {e.engine_id: e.generation for e in ray.get(dep.coordinator.engines.remote())}
                if d0_id in now and now[d0_id] != before.get(d0_id):
                    back = now[d0_id]
                    break
                time.sleep(0.25)
            result["node_loss_steps"] = [(e.engine, e.step) for e in ray.get(
                find_launcher(NAME).node_loss_events.remote(), timeout=30)]
            d0 = ray.get_actor(actor_name_of(d0_id), namespace=NAMESPACE)  # the new incarnation's actor
            place = ray.get(d0.placement.remote(), timeout=60)
            result["replaced_on_spare"] = back is not None and place["node_id"] == spare.node_id \
                and set(place["rank_nodes"]) == {spare.node_id}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and d0_id not in httpx.get(f"{url}/health", timeout=30).json().get(
                    "decode_engines", ()):
                time.sleep(0.25)
            d0_before = ray.get(d0.stats.remote()).requests
            final = asyncio.run(run_all(url, model, list(range(FINAL))))
            result["final"] = dict(classify(final, reference))
            result["final_on_replaced"] = ray.get(d0.stats.remote()).requests - d0_before
            after = wait_blocks_at_baseline(dep, baseline, timeout_s=60)
            result["blocks_at_baseline"] = {e: (s.free_blocks == baseline[e].free_blocks and s.held_leases == 0)
                                            for e, s in after.items()}
            events = ray.get(dep.coordinator.recent_events.remote(1000))
            result["d0_removed_as_dead"] = any(e["event"] == "removed" and e["engine_id"] == d0_id
                                               and "died" in e.get("reason", "") for e in events)
        shutdown_deployment(cfg.name)
        time.sleep(1)
        result["placement_groups_left"] = [
            i["name"] for i in ray.util.placement_group_table().values()
            if i.get("state") != "REMOVED" and (i.get("name") or "").startswith(f"raypd-{NAME}-")]
    except Exception as exc:  # the JSON line says where the run stopped
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        print(json.dumps(result), flush=True)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
