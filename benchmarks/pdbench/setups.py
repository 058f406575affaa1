"""The serving set-ups under test, each a group of processes this benchmark starts and stops.

  PlainVllm   (a)  vLLM's OpenAI server on core 0, queried directly;
              (a2) the same server plus a second one on core 1 behind a least-loaded balancer
  WideVllm    (a') one vLLM OpenAI server computing on both cores (VLLM_CPU_OMP_THREADS_BIND 0-1): the
                   CPU twin of one TP-2 engine, the colocated baseline of DistServe-style comparisons
  RaypdUp     (b)  `raypd up` with one prefill (core 0) and one decode (core 1) engine, its real front;
              (e)  `raypd up` as shipped: two role-flexible engines (cores 0, 1), SLO-aware placement
              (e0) (e) with placement that never disaggregates (pdbench/colocated.py)
              (ep) the shape `raypd config --plan` picks for the benchmark's load (pdbench/planned.py)
  VllmNixlPD  (c)  two vLLM OpenAI servers with NixlConnector (prefill core 0, decode core 1) and a proxy
                   doing what vLLM's documented disaggregated proxy does
  ServeLLM    (d)  Ray Serve LLM's `build_pd_openai_app` (NixlConnector), as shipped;
              (dc) its colocated twin `build_openai_app` (one engine, core 0)

Each is a `Group` (`pdbench/group.py`); `RaypdUp` lives in `pdbench/raypd_up.py`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pdbench.group import HERE, Group, SetupError, free_port
from pdbench.raypd_up import RaypdUp

class PlainVllm(Group):
    key = "A"

    def start(self) -> None:
        p0, p1, pb = free_port(), free_port(), free_port()
        self.vllm_server("engine0", "0", p0)
        self.vllm_server("engine1", "1", p1)
        u0, u1 = f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p1}"
        self.wait_ready([u0, u1], self.s["start_timeout_s"])
        self.proxy(pb, ["balance", "--backend", u0, "--backend", u1])
        ub = f"http://127.0.0.1:{pb}"
        self.wait_ready([ub], 60)
        self.endpoints = {"a": u0, "a2": ub}


class WideVllm(Group):
    key = "AP"

    def start(self) -> None:
        port = free_port()
        self.vllm_server("engine", "0-1", port)  # vLLM binds its two OpenMP threads itself (one per core)
        url = f"http://127.0.0.1:{port}"
        self.wait_ready([url], self.s["start_timeout_s"])
        self.endpoints = {"ap": url}


class VllmNixlPD(Group):
    key = "C"

    def start(self) -> None:
        pp, pd, px = free_port(), free_port(), free_port()
        self.vllm_server("prefill", "0", pp, nixl_side_port=free_port())
        self.vllm_server("decode", "1", pd, nixl_side_port=free_port())
        up, ud = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{pd}"
        self.wait_ready([up, ud], self.s["start_timeout_s"])
        self.proxy(px, ["pd", "--prefill", up, "--decode", ud])
        ux = f"http://127.0.0.1:{px}"
        self.wait_ready([ux], 60)
        self.endpoints = {"c": ux}


SERVE_TEMP = "/tmp/raypd-bench-serve"


class ServeLLM(Group):
    def __init__(self, settings: dict, model_path: str, run_dir: Path, mode: str):
        super().__init__(settings, model_path, run_dir)
        self.mode = mode
        self.key = "D" if mode == "pd" else "DC"

    def start(self) -> None:
        port = free_port()
        keys = ("dtype", "max_model_len", "block_size", "enable_prefix_caching", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_gib", "served_model_name")
        self.spawn("serve-llm", [sys.executable, str(HERE / "serve_llm_app.py"), "--mode", self.mode,
                                 "--model", self.model_path, "--port", str(port), "--temp-dir", SERVE_TEMP,
                                 "--settings", json.dumps({k: self.s[k] for k in keys})])
        url = f"http://127.0.0.1:{port}"
        self.wait_ready([url], self.s["start_timeout_s"])
        log = self.log_paths[-1]
        deadline = time.monotonic() + self.s["start_timeout_s"]
        while "READY" not in log.read_text(errors="replace"):
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise SetupError(f"Serve LLM ({self.mode}) did not deploy (log: {log})")
            time.sleep(0.5)
        self.endpoints = {"d" if self.mode == "pd" else "dc": url}

    def session_logs(self) -> Path:
        return Path(SERVE_TEMP) / "session_latest" / "logs"


def make_group(key: str, settings: dict, model_path: str, run_dir: Path) -> Group:
    if key == "A":
        return PlainVllm(settings, model_path, run_dir)
    if key in RaypdUp.CONFIGS:
        return RaypdUp(settings, model_path, run_dir, key)
    if key == "AP":
        return WideVllm(settings, model_path, run_dir)
    if key == "C":
        return VllmNixlPD(settings, model_path, run_dir)
    if key in ("D", "DC"):
        return ServeLLM(settings, model_path, run_dir, "pd" if key == "D" else "colocated")
    raise ValueError(f"unknown set-up group {key!r}")
