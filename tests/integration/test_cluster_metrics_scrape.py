"""Metrics cluster-wide: `raypd up` (SmolLM2, 1 prefill + 1 decode, two ingress replicas), traffic,
then a scrape of the URLs `raypd status` prints: vLLM's metrics of both engines, and raypd's
request total and prefill decisions equal to the requests sent (summed over the replicas that served them)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service_helpers import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RAYPD = [sys.executable, "-m", "serving.cli"]
REQUESTS = 8


def scrape(urls: list[str]) -> list:
    samples = []
    for url in urls:
        text = httpx.get(url, timeout=30).text
        samples += [s for f in text_string_to_metric_families(text) for s in f.samples]
    return samples


def test_status_urls_show_both_engines_vllm_metrics_and_raypd_totals(tmp_path):
    port = free_port()
    temp_dir = f"/tmp/raypd-metrics-{uuid.uuid4().hex[:8]}"
    base = yaml.safe_load((ROOT / "configs" / "local-pd.yaml").read_text())
    base.update(name="metrics-test", max_model_len=512)
    base["http"] = {"host": "127.0.0.1", "port": port, "num_replicas": 2}
    config = tmp_path / "metrics.yaml"
    config.write_text(yaml.safe_dump(base))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*RAYPD, "up", "--config", str(config), "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Ctrl-C to stop" not in log.read_text():
            assert proc.poll() is None, f"raypd up exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"raypd up did not come up:\n{log.read_text()}"
            time.sleep(1)

        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]

        def one(i: int) -> int:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300,
                           json={"model": model, "prompt": f"Count to {i}:", "max_tokens": 4})
            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(one, range(REQUESTS)))
        assert codes == [200] * REQUESTS

        status = subprocess.run([*RAYPD, "status", "--json", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=180)
        urls = json.loads(status.stdout)["metrics_urls"]
        engines = set(json.loads(status.stdout)["engines"])
        deadline = time.monotonic() + 90  # Ray's agent exports every few seconds
        while True:
            samples = scrape(urls)
            total = sum(s.value for s in samples if s.name == "ray_raypd_requests_total"
                        and s.labels.get("status") == "200")
            vllm_engines = {s.labels.get("engine_id") for s in samples
                            if s.name == "ray_vllm_time_to_first_token_seconds_count" and s.value > 0}
            decisions = {}
            for s in samples:
                if s.name == "ray_raypd_disagg_decisions_total":
                    key = (s.labels["decision"], s.labels["reason"])
                    decisions[key] = decisions.get(key, 0) + s.value
            seen = (total, vllm_engines, decisions)
            want = (REQUESTS, engines, {("remote", "uncached_prompt"): REQUESTS})  # short_prompt_tokens 0
            if seen == want or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert seen == want
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        subprocess.run(["rm", "-rf", temp_dir], check=False)
