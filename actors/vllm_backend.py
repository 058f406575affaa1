"""vLLM (AsyncLLM) behind an EngineActor, with RayNixlConnector moving the KV.

Life cycle of a P/D request here:

  prefill engine  prefill(req)  runs the prompt with max_tokens=1 and
                  do_remote_decode; returns the first sampled token (the
                  router streams it to the client at once: TTFT is the
                  prefill engine's) and the transfer params;
  decode engine   generate(req) the prompt is the original prompt plus that
                  first token; the params (completed here with the producer
                  ranks' handshake payloads, fetched from the coordinator)
                  make the connector pull the prompt's KV; vLLM computes
                  only the new token and streams on.

The engine core and workers are child processes of this actor (vLLM on CPU
always runs AsyncLLM's core in a subprocess); their ranks publish handshake
payloads into a per-engine folder this backend collects for the coordinator.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from actors.engine_config import EngineConfig
from actors.kv.handshake import decode_handshake
from actors.kv.topology import TransferTopology
from actors.protocol import EngineRequest, EngineRequestError, PrefillResult, SamplingSpec, TokenChunk
from actors.transfer_params import TransferParams, TransferParamsError

logger = logging.getLogger("raypd.vllm")


def _usage_logger_factory(sink: dict):
    """A vLLM stat logger that keeps the last scheduler stats (KV usage, queue depths)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KVUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            sink["num_blocks"] = vllm_config.cache_config.num_gpu_blocks or 0

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                sink["kv_cache_usage"] = scheduler_stats.kv_cache_usage
                sink["running"] = scheduler_stats.num_running_reqs
                sink["waiting"] = scheduler_stats.num_waiting_reqs

        def log_engine_initialized(self) -> None:
            return None

    return KVUsageLogger


class VllmBackend:
    def __init__(self, cfg: EngineConfig, engine_id: str, start_timeout_s: float = 600.0):
        self.cfg, self.engine_id = cfg, engine_id
        self.start_timeout_s = start_timeout_s
        self.llm: Any = None
        self.tokenizer: Any = None
        self.coordinator: Any = None
        self._handshakes: list[bytes] = []
        self._peer_payloads: dict[str, dict[int, list[str]]] = {}  # engine -> pp -> payloads
        self._own: Any = None  # decoded handshake of our rank 0
        self.handshake_dir = tempfile.mkdtemp(prefix=f"raypd-{engine_id}-")
        self.counters = {"kv_pulls": 0, "kv_failures": 0, "recomputed": 0}
        self._usage: dict[str, Any] = {"num_blocks": 0, "kv_cache_usage": 0.0, "running": 0, "waiting": 0}

    # ---------------------------------------------------------------- start
    def _engine_args(self, model_path: str) -> Any:
        from actors.engine_args import build_engine_args, pd_kv_transfer, pd_overrides

        cfg = self.cfg
        kv = pd_kv_transfer(cfg, self.engine_id, {
            "engine_id": self.engine_id,
            "handshake_dir": self.handshake_dir,
            "model_id": cfg.served_model_id,
            "lease_ttl_s": cfg.lease_ttl_s,
            "read_timeout_s": cfg.read_timeout_s,
            "fault_rate": cfg.fault_rate,
        }) if cfg.kv_connector else None  # None: plain vLLM (baseline)
        for note in pd_overrides(cfg):
            logger.warning("%s: %s", self.engine_id, note)
        return build_engine_args(cfg, model_path, kv)

    async def start(self, coordinator: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.engine_args import EffectiveEngineConfig
        from actors.models import resolve_model

        self.coordinator = coordinator
        model_path = str(await asyncio.to_thread(resolve_model, self.cfg.model))
        engine_args = self._engine_args(model_path)  # refuses a bad engine_kwargs key before any process starts
        self.llm = AsyncLLM.from_engine_args(engine_args, stat_loggers=[_usage_logger_factory(self._usage)])
        self.effective_config = EffectiveEngineConfig.from_vllm_config(self.llm.vllm_config)
        self.tokenizer = self.llm.tokenizer if getattr(self.llm, "tokenizer", None) else await self.llm.get_tokenizer()
        if self.cfg.kv_connector:
            self._handshakes = await self._collect_handshakes()
            self._own = decode_handshake(self._handshakes[0])

    async def _collect_handshakes(self) -> list[bytes]:
        from actors.connector.worker import handshake_file

        expected = [handshake_file(self.handshake_dir, p, t)
                    for p in range(self.cfg.pp_size) for t in range(self.cfg.tp_size)]
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in expected):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.engine_id}: vLLM workers published no handshake in 60 s")
            await asyncio.sleep(0.05)
        return [f.read_bytes() for f in expected]

    def handshakes(self) -> list[bytes]:
        return list(self._handshakes)

    def liveness_handles(self) -> list[Any]:
        return []

    # ------------------------------------------------------------- requests
    def _prompt(self, req: EngineRequest) -> list[int]:
        if req.prompt_token_ids:
            ids = list(req.prompt_token_ids)
        elif req.messages:
            try:
                text = self.tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=True,
                                                          tokenize=False)
            except Exception as exc:  # noqa: BLE001 - template errors are the client's
                raise EngineRequestError(f"cannot apply the chat template: {exc}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif req.prompt:
            ids = self.tokenizer.encode(req.prompt)
        else:
            raise EngineRequestError("the prompt is empty")
        if len(ids) + req.max_tokens > self.cfg.max_model_len:
            raise EngineRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context length "
                f"{self.cfg.max_model_len}"
            )
        return ids

    def _sampling(self, spec: SamplingSpec, max_tokens: int, kv_params: dict | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if spec.temperature is None else spec.temperature,
            top_p=1.0 if spec.top_p is None else spec.top_p,
            seed=spec.seed,
            stop=list(spec.stop) or None,
            ignore_eos=spec.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_params} if kv_params else None,
        )

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Prefill for remote decode: first token + transfer params."""
        ids = self._prompt(req)
        ttl = req.lease_ttl_s or self.cfg.lease_ttl_s
        # max_tokens 1: the first token is the whole answer, nothing to hand off
        remote = req.max_tokens > 1
        sp = self._sampling(req.sampling, 1, {"do_remote_decode": True, "lease_ttl_s": ttl} if remote else None)
        first_ids: list[int] = []
        text, finish, params = "", None, None
        async for out in self.llm.generate({"prompt_token_ids": ids}, sp, request_id=req.request_id):
            o = out.outputs[0]
            first_ids.extend(o.token_ids)
            text += o.text
            if out.finished:
                finish, params = o.finish_reason, out.kv_transfer_params
        return PrefillResult(prompt_token_ids=tuple(ids), first_token_ids=tuple(first_ids), first_text=text,
                             finish_reason=str(finish) if finish is not None else None,
                             kv_transfer_params=params)

    async def _with_handshakes(self, params: dict) -> dict:
        """Attach the payloads of exactly the producer ranks our ranks read from."""
        p = TransferParams.parse(params)
        payloads: list[str] = []
        for pp_rank in range(p.pp_size):
            cached = self._peer_payloads.get(p.remote_engine_id, {}).get(pp_rank)
            if cached is None:
                targets: set[int] = set()
                own = self._own
                for rank in range(self.cfg.tp_size):
                    topo = TransferTopology(rank, self.cfg.tp_size, own.block_size, self.engine_id,
                                            own.compat.is_mla, False, own.compat.num_kv_heads)
                    targets.update(topo.handshake_target_ranks(p.tp_size, p.dcp_size))
                raw = await self.coordinator.handshake_payloads.remote(p.remote_engine_id, pp_rank, sorted(targets))
                cached = [base64.b64encode(b).decode() for b in raw]
                self._peer_payloads.setdefault(p.remote_engine_id, {})[pp_rank] = cached
            payloads.extend(cached)
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        # (vLLM would report the producer's prefix hits instead of what we pulled.)
        return {**params, "do_remote_prefill": True, "handshakes": payloads}

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]:
        ids = self._prompt(req)
        params = req.kv_transfer_params
        expected_external = 0
        if params:
            try:
                params = await self._with_handshakes(params)
            except TransferParamsError as exc:
                raise EngineRequestError(str(exc)) from None
            expected_external = min(int(params["num_tokens"]), len(ids) - 1)
            self.counters["kv_pulls"] += 1
        sp = self._sampling(req.sampling, req.max_tokens, params)
        req_id = req.request_id
        first = True
        async for out in self.llm.generate({"prompt_token_ids": ids}, sp, request_id=req_id):
            o = out.outputs[0]
            chunk = TokenChunk(req_id, tuple(o.token_ids), o.text, finished=out.finished,
                               num_prompt_tokens=len(ids) - req.num_resumed_tokens)
            if first:
                # vLLM reports cached tokens on the first delta: fewer than we pulled means
                # the pull failed and the prompt was recomputed (kv_load_failure_policy=recompute).
                first = False
                cached = out.num_cached_tokens or 0
                recomputed = bool(params and cached < expected_external and o.token_ids)
                chunk = chunk.replace(num_cached_tokens=cached, recomputed=recomputed)
                if recomputed:
                    self.counters["recomputed"] += 1
                if params:
                    self._report(req_id, recomputed or (out.finished and str(o.finish_reason) == "error"))
            if out.finished:
                reason = str(o.finish_reason) if o.finish_reason is not None else "stop"
                chunk = chunk.replace(finish_reason=reason)
                if reason == "error":
                    self.counters["kv_failures"] += 1
                    chunk = chunk.replace(error="KV transfer failed (kv_load_failure_policy=fail)")
            yield chunk

    def _report(self, req_id: str, failed: bool) -> None:
        """One outcome per pulled request to the coordinator's ledger (vLLM merged its ranks)."""
        if self.coordinator is None:
            return
        from actors.kv.aggregator import KVConnectorOutput

        out = KVConnectorOutput(finished_recving={req_id}, failed_recving={req_id} if failed else set(),
                                expected_finished_count=1)
        self.coordinator.report_outcomes.remote(self.engine_id, [out])

    async def abort(self, req_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(req_id)

    async def drop_engine(self, engine_id: str) -> None:
        # The next request to that engine fetches fresh payloads; workers replace
        # agents whose name changed (a restarted engine never meets stale metadata).
        self._peer_payloads.pop(engine_id, None)

    async def stats(self) -> dict:
        """Counters plus the scheduler's view as of its last step (vLLM reports per step)."""
        u = self._usage
        total = int(u["num_blocks"])
        return {"backend": "vllm", **self.counters, "num_blocks": total,
                "free_blocks": round((1.0 - float(u["kv_cache_usage"])) * total),
                "engine_running": u["running"], "engine_waiting": u["waiting"]}

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        await asyncio.to_thread(_reap_children)
        shutil.rmtree(self.handshake_dir, ignore_errors=True)


def _reap_children(grace_s: float = 3.0) -> None:
    """vLLM's engine core and workers are our child processes: make sure none outlives the engine
    (a slow shutdown on a loaded machine must not strand them once the actor is killed)."""
    import psutil

    def is_vllm(proc: "psutil.Process") -> bool:
        try:
            return "resource_tracker" not in " ".join(proc.cmdline() or [])
        except psutil.Error:
            return False

    children = [c for c in psutil.Process().children(recursive=True) if is_vllm(c)]
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
