"""vLLM (AsyncLLM) behind an EngineActor, with RayNixlConnector moving the KV.

Prompts arrive as token ids and sampling parameters as the `vllm.SamplingParams` the front derived
(engines never tokenize a prompt). A prefill engine runs the prompt with max_tokens=1 and holds its
blocks under a lease until the readers' notices (or the lease's TTL) free them; a decode engine
pulls the KV of every prompt token and continues the answer (`actors.engine.vllm.decode`).
Invariants: a request vLLM refuses because of the request itself is an `EngineRequestError` (a 400,
never an engine failure); a prefill nobody will read is released, not left to its TTL; vLLM's child
processes are recorded, so a restarted actor reaps what its killed predecessor left
(`actors.engine.vllm.orphans`). The life cycle of a P/D request here: `VllmBackend`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from actors.engine.config import EngineConfig
from actors.engine.vllm.extra_config import ConnectorExtraConfig
from actors.engine.vllm.uniproc import core_process_env
from actors.kv.handshake import decode_handshake
from actors.engine.vllm.kv_events import KVEventsSource, endpoint_in, vllm_kv_events_config
from actors.engine.vllm.leases import UnreadLeases, lease_ends_logger
from actors.prefix_wire import DEFAULT_SEED, HashScheme
from actors.engine.vllm.orphans import Child, forget, live_pids, reap_children, reap_previous, record_children
from actors.protocol.request import EngineRequest, ModelInfo, PrefillResult, TokenChunk
from actors.protocol.stats import BackendStats
from actors.engine.vllm.peer_payloads import PeerPayloads
from actors.engine.vllm.requests import engine_outputs, logprobs_of, prompt_ids, sampling_params, usage_sink
from actors.transfer_params import TransferParams

if TYPE_CHECKING:
    from actors.engine.vllm.decode import DecodePath

logger = logging.getLogger("raypd.vllm")


class VllmBackend:
    """Life cycle of a P/D request here:

      prefill engine  prefill(req)  runs the prompt with max_tokens=1 and
                      do_remote_decode; returns the first sampled token (the
                      router streams it to the client at once: TTFT is the
                      prefill engine's) and the transfer params;
      decode engine   generate(req) the request is the prompt plus that first
                      token (`num_resumed_tokens` 1); the params (completed here
                      with the producer ranks' handshake payloads, fetched from the
                      coordinator) make the connector pull the KV of every prompt
                      token, and the engine's first step computes only the first
                      token's KV and samples the second. Penalties, min_tokens,
                      stop strings, logprobs and seeded sampling see the answer as
                      one vLLM engine would (`actors.engine.vllm.decode`); the few
                      parameters that need it replay the first token instead.
      prefill engine  the readers' notices release the lease on the producer's
                      ranks; the connector reports that through vLLM's step stats
                      and the prefill stops counting as a held lease at once (what a
                      drain waits for: `actors.engine.vllm.leases`), not at its TTL,
                      which bounds only readers that never come.

    Prompts arrive as token ids (the front renders and tokenizes); the sampling
    parameters arrive as the `vllm.SamplingParams` the front derived the way vLLM's
    OpenAI server does (`SamplingSpec.vllm_params`, pickled).

      either          abort(req_id) a running request is aborted in vLLM; a
                      prefill nobody will read (its blocks held under a lease) is
                      released through vLLM's rejection hook
                      (`notify_kv_transfer_request_rejected`): the connector's
                      scheduler side puts it on the release list of the next step's
                      metadata and the workers free the lease in that step.

    Requests vLLM refuses because of the request itself (`VLLMClientError`, or a
    ValueError raised while vLLM admits it: vocabulary, length, sampling params)
    become `EngineRequestError`: a 400 for the client, never an engine failure.

    The engine core (and workers, for several ranks or `distributed_executor_backend: mp`; a one-rank
    CPU engine runs its model in the core: `actors.engine.vllm.uniproc`) are child processes of this
    actor (AsyncLLM always runs its core in a subprocess); their ranks publish handshake
    payloads into a per-engine folder this backend collects for the coordinator.
    Their pids are recorded, so a restarted actor reaps what its killed
    predecessor left behind (`actors.engine.vllm.orphans`).
    """

    def __init__(self, cfg: EngineConfig, engine_id: str, start_timeout_s: float = 600.0):
        self.cfg, self.engine_id = cfg, engine_id
        self.start_timeout_s = start_timeout_s
        self.llm: Any = None
        self._children: tuple[Child, ...] = ()  # vLLM's processes, recorded once it started (orphans.py)
        self.coordinator: Any = None
        self.ledger: Any = None  # set by start()
        self._handshakes: list[bytes] = []
        self.peers = PeerPayloads(engine_id, cfg.tp_size)  # producers' payloads our requests carry
        self.incarnation = uuid.uuid4().hex[:12]  # suffix of our ranks' agent names, stamped on our params
        self.handshake_dir = tempfile.mkdtemp(prefix=f"raypd-{engine_id}-")
        self.counters = {"kv_pulls": 0, "kv_failures": 0, "recomputed": 0, "replays": 0, "replay_mismatches": 0,
                         "inexact_resumes": 0, "released": 0}
        self.decode: DecodePath | None = None  # once the engine runs
        # prefills whose blocks are held for a reader, until the engine reports the lease ended (or its TTL)
        self._unread = UnreadLeases(self.counters)  # counts leases_released_by_notice, leases_expired
        self.kv_events_endpoint = endpoint_in(self.handshake_dir)  # the engine core publishes its KV events here
        self._usage: dict[str, Any] = {"num_blocks": 0, "kv_cache_usage": 0.0, "running": 0, "waiting": 0}

    # ---------------------------------------------------------------- start
    def _engine_args(self, model_path: str) -> Any:
        from actors.engine.vllm.args import build_engine_args, pd_kv_transfer, pd_overrides

        cfg = self.cfg
        kv = None  # plain vLLM (the baseline): no connector
        if cfg.kv_connector:
            extra = ConnectorExtraConfig(engine_id=self.engine_id, handshake_dir=self.handshake_dir,
                                         model_id=cfg.served_model_id, incarnation=self.incarnation,
                                         transfer=cfg.transfer)
            kv = pd_kv_transfer(cfg, self.engine_id, extra.to_extra_config())
        for note in pd_overrides(cfg):
            logger.warning("%s: %s", self.engine_id, note)
        args = build_engine_args(cfg, model_path, kv)
        if not cfg.kv_events:  # router.policy least_outstanding: nobody reads the events
            return args
        if args.kv_events_config is not None:
            logger.warning("%s: engine_kwargs.kv_events_config is replaced: raypd relays the engine's KV cache "
                           "events to its routers", self.engine_id)
        args.kv_events_config = vllm_kv_events_config(self.kv_events_endpoint)  # feeds the prefix index
        return args

    async def start(self, coordinator: Any, on_new_incarnation: Callable[[], Awaitable[Any]] | None = None,
                    ledger: Any = None) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.engine.vllm.args import EffectiveEngineConfig
        from actors.engine.vllm.serve_defaults import usage_context
        from actors.models.local import resolve_model

        self.coordinator = coordinator
        self.ledger = ledger  # actors.engine.ledger_reporter.LedgerReporter: outcomes, coalesced
        await asyncio.to_thread(reap_previous, self.engine_id)  # a killed predecessor's engine core
        model_path = str(await asyncio.to_thread(resolve_model, self.cfg.model))
        engine_args = self._engine_args(model_path)  # refuses a bad engine_kwargs key before any process starts
        with core_process_env(self.cfg):  # a `uni` engine's core runs the model: bound as a worker would be
            # `vllm serve`'s usage context: vLLM's batch defaults for this GPU are those `vllm serve` would use
            self.llm = AsyncLLM.from_engine_args(engine_args, usage_context=usage_context(),
                                                 stat_loggers=self._stat_loggers())
        self._children = record_children(self.engine_id)
        self.effective_config = EffectiveEngineConfig.from_vllm_config(self.llm.vllm_config)
        from actors.engine.vllm.decode import DecodePath, DecodeWiring, decode_caps

        wiring = DecodeWiring(engine_id=self.engine_id, llm=self.llm, max_model_len=self.cfg.max_model_len,
                              kv_load_failure_policy=self.cfg.transfer.failure_policy, counters=self.counters,
                              attach=self._attach, report_pull=self._report, handshake_failed=self._handshake_failed)
        self.decode = DecodePath(wiring, decode_caps(self.llm.vllm_config))
        if self.cfg.kv_connector:
            self._handshakes = await self._collect_handshakes()
            self.peers.own = decode_handshake(self._handshakes[0])

    def _stat_loggers(self) -> list[Any]:
        """Our scheduler-stats sink, the connector's lease ends (what ends our held leases), and
        vLLM's Prometheus metrics through Ray's metrics agent (tagged with this engine's id and
        role) when running in a Ray process."""
        import ray

        loggers: list[Any] = [usage_sink(self._usage), lease_ends_logger(self._unread.ended)]
        if ray.is_initialized():
            from actors.engine.vllm.metrics import engine_stat_logger

            loggers.append(engine_stat_logger(self.engine_id, self.cfg.role))
        return loggers

    async def _collect_handshakes(self) -> list[bytes]:
        from actors.engine.vllm.connector.worker import handshake_file

        expected = [handshake_file(self.handshake_dir, p, t)
                    for p in range(self.cfg.pp_size) for t in range(self.cfg.tp_size)]
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in expected):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.engine_id}: vLLM workers published no handshake in 60 s")
            await asyncio.sleep(0.05)
        return [f.read_bytes() for f in expected]

    async def handshakes(self) -> list[bytes]:
        return list(self._handshakes)

    def liveness_handles(self) -> list[Any]:
        return []  # the engine core is our child: its death is vLLM's EngineDeadError, seen here

    def coordinator_changed(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def dead_reason(self) -> str | None:
        if self.llm is not None and self.llm.errored:
            return "vLLM's engine core died"
        return None

    async def probe(self) -> None:
        """A round trip through the engine core's busy loop (a utility call, answered between
        steps): returns once the core is not stuck (the liveness probe, `EngineActor.ping`)."""
        if self.llm is not None:
            await self.llm.is_sleeping()

    def steps(self) -> int:
        """Engine-core steps whose outputs reached this process so far (progress evidence: a core
        that is slow to answer a probe but still steps is busy, not stuck)."""
        return self._usage.get("core_outputs", 0)

    def kv_events_source(self) -> KVEventsSource | None:
        """Where the engine core publishes its KV events and how it hashes blocks (as vLLM resolved it)."""
        cache = self.llm.vllm_config.cache_config
        if not self.cfg.kv_events or not cache.enable_prefix_caching:
            return None
        seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED  # the engine core inherits our environment
        return KVEventsSource(self.kv_events_endpoint,
                              HashScheme(cache.block_size, cache.prefix_caching_hash_algo, seed))

    # ------------------------------------------------------------- requests
    def model_info(self) -> ModelInfo:
        mc = self.llm.model_config
        defaults = mc.get_diff_sampling_param()
        override = (defaults.get("max_tokens") if mc.generation_config not in ("auto", "vllm")
                    else mc.override_generation_config.get("max_new_tokens"))  # as vLLM's serving code
        return ModelInfo(backend="vllm", max_model_len=mc.max_model_len, vocab_size=mc.get_vocab_size(),
                         model_path=mc.model, tokenizer=mc.tokenizer, tokenizer_mode=mc.tokenizer_mode,
                         trust_remote_code=mc.trust_remote_code, default_sampling_params=defaults,
                         override_max_tokens=override)

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Prefill for remote decode: first token + transfer params."""
        ids = prompt_ids(req, self.cfg.max_model_len)
        ttl = req.lease_ttl_s or self.cfg.transfer.lease_ttl_s
        # max_tokens 1: the first token is the whole answer, nothing to hand off
        remote = req.max_tokens > 1
        sp = sampling_params(req.sampling, 1, {"do_remote_decode": True, "lease_ttl_s": ttl} if remote else None)
        first_ids: list[int] = []
        text, finish, params, cached, logprobs, cumulative = "", None, None, None, [], None
        async for out in engine_outputs(self.llm, ids, sp, req.request_id):
            cached = out.num_cached_tokens if cached is None else cached
            o = out.outputs[0]
            first_ids.extend(o.token_ids)
            text += o.text
            logprobs.extend(logprobs_of(o.logprobs) or ())
            cumulative = o.cumulative_logprob
            if out.finished:
                finish, params = o.finish_reason, out.kv_transfer_params
        if params and params.get("remote_request_id"):
            self._unread.remember(req.request_id, params["remote_request_id"], ttl)
            params = {**params, "remote_incarnation": self.incarnation}
        from actors.engine.vllm.decode import held_chars

        return PrefillResult(prompt_token_ids=tuple(ids), first_token_ids=tuple(first_ids), first_text=text,
                             finish_reason=str(finish) if finish is not None else None,
                             kv_transfer_params=params, num_cached_tokens=cached,
                             first_logprobs=tuple(logprobs) if sp.logprobs is not None else None,
                             cumulative_logprob=cumulative if sp.logprobs is not None else None,
                             held_chars=held_chars(sp))

    def generate(self, req: EngineRequest, params: TransferParams | None) -> AsyncIterator[TokenChunk]:
        """Stream a request (colocated, or resuming an answer: `actors.engine.vllm.decode`)."""
        if self.decode is None:
            raise RuntimeError(f"{self.engine_id}: generate before the engine started")
        return self.decode.generate(req, params)

    def _attach(self, params: TransferParams) -> Awaitable[dict]:
        """`params` as vLLM's connector reads them, with the producer's payloads (from the coordinator
        as it is now: it changes when the coordinator restarts)."""
        return self.peers.attach(params, self.coordinator)

    def _handshake_failed(self, prefill_id: str, reason: str, req_id: str) -> None:
        """A pull that could not start: the ledger hears it as the pair's handshake failure."""
        if self.ledger is not None:
            self.ledger.handshake_failed(prefill_id, reason, req_id)

    def _report(self, req_id: str, failed: bool) -> None:
        """One outcome per pulled request to the coordinator's ledger (vLLM merged its ranks), a failed
        one with why, when the connector said so (it did with the step's stats, before any output)."""
        if self.ledger is None:
            return
        from actors.kv.aggregator import KVConnectorOutput

        why = self._unread.pull_failures.reason(req_id) if failed else None
        out = KVConnectorOutput(finished_recving={req_id}, failed_recving={req_id} if failed else set(),
                                expected_finished_count=1, failure_reasons={req_id: why} if why else {})
        self.ledger.outcomes([out])

    async def abort(self, req_id: str) -> None:
        """Abort a running request; release a finished prefill's held blocks (nobody will read them)."""
        if self.llm is None:
            return
        unread = self._unread.pop(req_id)
        if unread is None:
            await self.llm.abort(self.decode.vllm_ids(req_id) if self.decode is not None else [req_id])
            return
        # The prefill finished: vLLM's abort would not find it. Its rejection hook submits an
        # aborted request whose params name the held one; our scheduler side releases it.
        from actors.engine.vllm.connector.scheduler import RELEASE_KEY

        self.counters["released"] += 1
        await self.llm.notify_kv_transfer_request_rejected(f"{unread}-release", {RELEASE_KEY: unread})

    async def drop_engine(self, engine_id: str) -> None:
        # The next request to that engine fetches fresh payloads; workers replace
        # agents whose name changed (a restarted engine never meets stale metadata).
        self.peers.drop(engine_id)

    async def stats(self) -> BackendStats:
        """Counters plus the scheduler's view as of its last step (vLLM reports per step); held
        leases are the prefills whose blocks still wait for their reader (until the engine reports
        the lease read, expired or released, or its TTL passed here)."""
        u = self._usage
        total = int(u["num_blocks"])
        return BackendStats("vllm", num_blocks=total, free_blocks=round((1.0 - float(u["kv_cache_usage"])) * total),
                            held_leases=len(self._unread), child_pids=tuple(live_pids(self._children)),
                            counters={**self.counters, "engine_running": u["running"],
                                      "engine_waiting": u["waiting"],
                                      **{k: v for k, v in u.items() if k.startswith(("prompt_", "compute_"))}})

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        await asyncio.to_thread(reap_children)
        shutil.rmtree(self.handshake_dir, ignore_errors=True)
        forget(self.engine_id)

