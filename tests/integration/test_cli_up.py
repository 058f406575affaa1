"""`raypd up` in a subprocess with Ray's defaults (token authentication on, its own cluster, temp dir and HOME),
start-up progress, API keys from the environment, requests, `raypd status` (recorded and explicit address),
`raypd profile` (its file reads back), `raypd down`, nothing left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from process_helpers import cmdline, descendants, reap, survivors, wait_for_line
from service_helpers import SYNTHETIC, free_port
from serving.sizing.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
RAYPD = [sys.executable, "-m", "serving.cli"]


def start_up(config: Path, temp_dir: str, log: Path, **env_vars: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """`raypd up --config` in a subprocess (its output into `log`), with Ray's variables of this
    environment dropped and `env_vars` set; the process and its environment (for `raypd down`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **env_vars)
    with open(log, "w") as out:
        proc = subprocess.Popen([*RAYPD, "up", "--config", str(config), "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, env


@pytest.mark.slow
def test_up_with_ray_token_auth_serves_then_down_leaves_nothing(tmp_path):
    port = free_port()
    temp_dir = f"/tmp/raypd-cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({**SYNTHETIC, "name": "cli-test",
                                      "http": {"host": "127.0.0.1", "port": port}, "ray": {"num_cpus": 2}}))
    home = tmp_path / "home"  # Ray creates its token in $HOME/.ray/auth_token, as `ray.init` does by default
    home.mkdir()
    log = tmp_path / "up.log"
    proc, env = start_up(config, temp_dir, log, HOME=str(home), XDG_RUNTIME_DIR=str(tmp_path / "run"),
                         RAYPD_API_KEYS="sk-cli-1,sk-cli-2")
    tree: dict[int, str] = {}
    try:
        text = wait_for_line(log, proc, "Ctrl-C to stop", 180)
        assert f"http://127.0.0.1:{port}/v1 (ready)" in text, text
        assert "prefill cli-test-prefill-0" in text and "decode  cli-test-decode-0" in text, text
        token = (home / ".ray" / "auth_token").read_text().strip()
        assert "Ray token authentication on" in text and token not in text, text
        assert "sk-cli" not in text and "API keys required (2 from RAYPD_API_KEYS)" in text, text
        for eid in ("cli-test-prefill-0", "cli-test-decode-0"):  # one line per engine per phase
            for phase in ("placed on node", "loading weights", "KV cache registered", "handshake published", "ready"):
                assert len(re.findall(rf"raypd: +{eid} +{phase} +\d+\.\ds", text)) == 1, (eid, phase, text)
        assert re.search(rf"logs in {temp_dir}/session_[^/ ]+/logs ", text), text

        body = {"model": "synthetic-tiny", "prompt": "hello", "max_tokens": 3}
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        r = httpx.post(url, json=body, timeout=30, headers={"Authorization": "Bearer sk-cli-2"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        state_files = list((tmp_path / "run" / "raypd").glob("up-*.json"))
        assert len(state_files) == 1
        gcs = json.loads(state_files[0].read_text())["gcs_address"]
        # a client with the wrong token is refused by the cluster
        intruder = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r})"], cwd=ROOT,
                                  env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32},
                                  capture_output=True, text=True, timeout=120)
        assert intruder.returncode != 0 and "AuthenticationError" in intruder.stderr, intruder.stderr[-2000:]

        status = subprocess.run([*RAYPD, "status", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "front: healthy" in status.stdout and "cli-test-decode-0" in status.stdout, status.stdout
        assert "cli-test-prefill-0->cli-test-decode-0" in status.stdout and "closed" in status.stdout
        refused = subprocess.run([*RAYPD, "status", "--address", gcs, "--config", str(config)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)  # explicit address, token mode unset
        assert refused.returncode == 1 and "set RAY_AUTH_MODE=token" in refused.stderr, refused.stderr[-2000:]
        joined = subprocess.run([*RAYPD, "status", "--json", "--address", gcs, "--config", str(config)], cwd=ROOT,
                                env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert set(json.loads(joined.stdout)["engines"]) == {"cli-test-prefill-0", "cli-test-decode-0"}
        # `raypd profile` reaches the recorded cluster and the keyed front, and writes what the planner reads:
        # the one-unit prefill engine's size (the TP-2 decode engine only pulls: no prefill of its own)
        out = tmp_path / "profile.yaml"
        profile = subprocess.run([*RAYPD, "profile", "--temp-dir", temp_dir, "--out", str(out), "--api-key",
                                  "sk-cli-1", "--seconds", "1", "--batches", "1,2", "--prompt-words", "300"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert profile.returncode == 0, profile.stdout + profile.stderr
        assert load_profile(out).sizes == (1,), out.read_text()

        tree = descendants(proc.pid)
        names = " ".join(cmdline(p) for p in tree)
        assert "raylet" in names and "gcs_server" in names, names
        down = subprocess.run([*RAYPD, "down", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert down.returncode == 0 and "raypd down: stopped" in down.stdout, down.stdout + down.stderr
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert "raypd: stopped" in log.read_text()
        assert not state_files[0].exists()
        left = survivors(tree)
        assert not left, "left behind: " + "; ".join(f"{p} {cmdline(p)}" for p in left)
    finally:
        reap(proc, tree, temp_dir)


@pytest.mark.slow
def test_down_while_engines_launch_stops_the_launch_and_leaves_nothing(tmp_path):
    """`raypd up` records itself before its engines start: a `raypd down` sent mid-launch finds it, and the
    launch ends with nothing left (engines, Ray, the state file)."""
    temp_dir = f"/tmp/raypd-cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({  # every engine start held 15 s: `down` surely lands mid-launch
        **SYNTHETIC, "name": "cli-down", "ray": {"num_cpus": 2}, "http": {"host": "127.0.0.1", "port": free_port()},
        "synthetic": {**SYNTHETIC["synthetic"], "start_delay_s": 15.0}}))
    log = tmp_path / "up.log"
    proc, env = start_up(config, temp_dir, log, HOME=str(tmp_path), XDG_RUNTIME_DIR=str(tmp_path / "run"),
                         RAY_AUTH_MODE="disabled")
    tree: dict[int, str] = {}
    try:
        wait_for_line(log, proc, "placed on node", 120)  # engine processes exist, none has registered yet
        tree = descendants(proc.pid)
        down = subprocess.run([*RAYPD, "down", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert down.returncode == 0 and "raypd down: stopped" in down.stdout, down.stdout + down.stderr
        text = log.read_text()
        assert proc.wait(timeout=30) == 130, text
        assert "Ctrl-C to stop" not in text and "raypd: stopped" in text, text
        assert list((tmp_path / "run" / "raypd").glob("up-*.json")) == []
        left = survivors(tree)
        assert not left, "left behind: " + "; ".join(f"{p} {cmdline(p)}" for p in left)
    finally:
        reap(proc, tree, temp_dir)
