"""Serve your own model: `raypd up --model <local SmolLM2 folder> --engine-arg ...` with no YAML, vLLM
engines, answered over HTTP; the engine arguments reach both engines (read back from vLLM's own config
through `raypd status --json`); an invalid engine argument fails the engine's start, naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import ray

from process_helpers import descendants, reap, survivors, wait_for_line
from service_helpers import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RAYPD = [sys.executable, "-m", "serving.cli"]


@pytest.fixture(scope="module")
def smollm2_folder():
    from actors.models.local import smollm2_path

    return smollm2_path(progress=None)


def test_up_with_a_model_folder_serves_and_engine_args_reach_the_engines(tmp_path, smollm2_folder):
    port = free_port()
    temp_dir = f"/tmp/raypd-own-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    log = tmp_path / "up.log"
    argv = ["up", "--model", str(smollm2_folder), "--port", str(port), "--temp-dir", temp_dir,
            "--engine-arg", "max_num_seqs=6", "--engine-arg", "block_size=64",
            "--engine-arg", "enable_prefix_caching=false", "--engine-arg", "max_model_len=1024",
            "--engine-arg", "enforce_eager=true"]  # CPU: skip torch.compile (vLLM's default) to keep the test short
    with open(log, "w") as out:
        proc = subprocess.Popen([*RAYPD, *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    tree: dict[int, str] = {}
    try:
        text = wait_for_line(log, proc, "Ctrl-C to stop", 900)
        assert f"at http://127.0.0.1:{port}/v1 (ready)" in text, text
        tree = descendants(proc.pid)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1 and r.json()["choices"][0]["message"]["content"]

        status = subprocess.run([*RAYPD, "status", "--json", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        engines = json.loads(status.stdout)["engines"]
        seen = {eid: tuple(e["vllm_config"][k] for k in ("max_num_seqs", "block_size", "enable_prefix_caching",
                                                         "max_model_len", "enforce_eager", "kv_role", "model"))
                for eid, e in engines.items()}
        # no role counts: two role-flexible engines
        assert seen == {"raypd-both-0": (6, 64, False, 1024, True, "kv_both", str(smollm2_folder)),
                        "raypd-both-1": (6, 64, False, 1024, True, "kv_both", str(smollm2_folder))}

        down = subprocess.run([*RAYPD, "down", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert not survivors(tree), "processes left behind"
    finally:
        reap(proc, tree, temp_dir)


def test_an_invalid_engine_argument_fails_the_start_naming_it(coordinator, smollm2_folder):
    from serving.config import DeploymentConfig
    from serving.cluster.launcher import launch, shutdown_deployment

    cfg = DeploymentConfig.from_dict({  # not checked by the CLI here: the engine itself must refuse it
        "name": "bad-engine-arg", "model": str(smollm2_folder), "max_model_len": 512,
        "prefill": {"count": 0}, "decode": {"count": 1, "num_cpus": 0, "engine_kwargs": {"max_num_seqz": 4}}})
    phases = []
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="max_num_seqz: not a vLLM engine argument"):
            launch(cfg, timeout_s=300, on_phase=phases.append)
        assert [p.phase for p in phases] == ["placed on node", "loading weights", "failed"]
        assert "max_num_seqz" in phases[-1].detail
    finally:
        shutdown_deployment(cfg.name, keep_coordinator=True)
