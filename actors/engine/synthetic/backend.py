"""The synthetic engine behind an EngineActor: streamed 'generation' over real KV.

Prompts arrive as token ids (the front tokenizes with
`actors.engine.synthetic.tokenizer`); generated ids are rendered as short words, so
the HTTP front sees a real text stream. A decode whose KV fails verification
is an error, never an answer.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from actors.engine.config import EngineConfig
from actors.transfer_params import TransferParams
from actors.protocol.request import EngineRequest, EngineRequestError, ModelInfo, PrefillResult, TokenChunk
from actors.protocol.stats import BackendStats
from actors.engine.synthetic.engine import EngineShape, SyntheticEngine
from actors.engine.synthetic.outcomes import TransferFailed
from actors.engine.synthetic.pattern import generate_tokens
from actors.engine.synthetic.rank import SyntheticModel
from actors.engine.synthetic.tokenizer import render_token


class SyntheticBackend:
    def __init__(self, cfg: EngineConfig, engine_id: str, token_latency_s: float = 0.0):
        self.cfg, self.engine_id = cfg, engine_id
        m = cfg.synthetic
        self.model = SyntheticModel(model_id=m.model_id, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                                    head_size=m.head_size, is_mla=m.is_mla, vocab_size=m.vocab_size)
        self.shape = EngineShape(tp_size=cfg.tp_size, pp_size=cfg.pp_size, dcp_size=cfg.dcp_size,
                                 block_size=cfg.effective_block_size, num_blocks=m.num_blocks,
                                 layout="ND" if m.is_mla else m.layout)
        self.token_latency_s = token_latency_s
        self.engine: SyntheticEngine | None = None
        self._decoding: set[str] = set()

    async def start(self, coordinator: Any, on_new_incarnation: Callable[[], Awaitable[Any]] | None = None,
                    ledger: Any = None) -> None:
        # Registration is done by the EngineActor (it adds itself as a liveness handle).
        if self.cfg.synthetic.start_delay_s:  # a slow start (tests: a restart frozen before it registers)
            await asyncio.sleep(self.cfg.synthetic.start_delay_s)
        transfer = self.cfg.transfer
        self.engine = SyntheticEngine(self.engine_id, self.cfg.role, self.model, self.shape, coordinator,
                                      lease_ttl_s=transfer.lease_ttl_s, read_timeout_s=transfer.read_timeout_s,
                                      register=False, fault_rate=transfer.fault_rate, verify=transfer.verify,
                                      on_new_incarnation=on_new_incarnation, ledger=ledger,
                                      rank_max_restarts=self.cfg.max_restarts)
        await self.engine.start()

    async def handshakes(self) -> list[bytes]:
        await self.engine.ready()  # not while a rank is being replaced
        return list(self.engine.handshakes)

    def liveness_handles(self) -> list[Any]:
        return list(self.engine.ranks)

    def model_info(self) -> ModelInfo:
        return ModelInfo(backend="synthetic", max_model_len=self.cfg.max_model_len,
                         vocab_size=self.model.vocab_size)

    def coordinator_changed(self, coordinator: Any) -> None:
        self.engine.coordinator = coordinator

    def dead_reason(self) -> str | None:
        return self.engine.dead if self.engine is not None else None

    def _tokens(self, req: EngineRequest) -> list[int]:
        tokens = list(req.prompt_token_ids)
        if not tokens:
            raise EngineRequestError("the prompt is empty")
        bad = next((t for t in tokens if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise EngineRequestError(f"token id {bad} is out of vocabulary (size {self.model.vocab_size})")
        if len(tokens) + req.max_tokens > self.cfg.max_model_len:
            raise EngineRequestError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                f"the context length {self.cfg.max_model_len}"
            )
        return tokens

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """The prompt's KV is written (and leased when a decode engine will read it); the first
        token is sampled from it, exactly as the decode engine would."""
        tokens = self._tokens(req)
        seed = req.kv_seed
        params = await self.engine.prefill(req.request_id, tokens, seed=seed)
        try:
            checksums = await self.engine.read_prompt(tokens, params["remote_block_ids"], seed)
        except BaseException:
            await self.engine.abort(req.request_id)
            raise
        first = generate_tokens(checksums, 0, 1, self.model.vocab_size)
        text = render_token(first[0])
        stopped = any(s and s in text for s in req.sampling.stop)
        if stopped or req.max_tokens <= 1:
            await self.engine.abort(req.request_id)  # nobody will read it: free the blocks now
            return PrefillResult(tuple(tokens), tuple(first), text, "stop" if stopped else "length")
        return PrefillResult(tuple(tokens), tuple(first), text, "length", kv_transfer_params=params)

    async def generate(self, req: EngineRequest, params: TransferParams | None) -> AsyncIterator[TokenChunk]:
        req_id = req.request_id
        tokens = self._tokens(req)
        # A continuation's prompt ends with tokens already generated: the model's state is the
        # original prompt's KV (pulled, or computed here), and generation resumes after them.
        resumed = min(req.num_resumed_tokens, len(tokens) - 1)
        prompt = tokens[:len(tokens) - resumed]
        recomputed = False
        self._decoding.add(req_id)
        try:
            if params:
                try:
                    out = await self.engine.decode(req_id, params, prompt, seed=req.kv_seed,
                                                   max_tokens=1, timeout_s=self.cfg.transfer.read_timeout_s * 2)
                    if out["mismatches"]:
                        raise TransferFailed(req_id, [f"{out['mismatches']} KV elements failed verification"], set())
                except (TransferFailed, KeyError, TypeError, ValueError) as exc:
                    if self.cfg.transfer.failure_policy == "fail":
                        yield TokenChunk.error_chunk(req_id, f"KV transfer failed: {exc}", len(prompt))
                        return
                    out = await self.engine.generate_local(req_id, prompt, seed=req.kv_seed, max_tokens=1)
                    recomputed = True
            else:
                out = await self.engine.generate_local(req_id, prompt, seed=req.kv_seed, max_tokens=1)
            generated = generate_tokens(out["checksums"], resumed, req.max_tokens, self.model.vocab_size)
            text_so_far = ""
            stops = [s for s in req.sampling.stop if s]
            for i, tok in enumerate(generated):
                if self.token_latency_s:
                    await asyncio.sleep(self.token_latency_s)
                piece = render_token(tok)
                text_so_far += piece
                hit = next((s for s in stops if s in text_so_far), None)
                last = i == len(generated) - 1 or hit is not None
                yield TokenChunk(req_id, (tok,), piece, finished=last,
                                 finish_reason=("stop" if hit else "length") if last else None,
                                 recomputed=recomputed and i == 0, num_prompt_tokens=len(prompt))
                if hit:
                    return
        finally:
            self._decoding.discard(req_id)

    async def abort(self, req_id: str) -> None:
        await self.engine.abort(req_id)

    async def drop_engine(self, engine_id: str) -> None:
        return None  # the rank actors were told directly by the coordinator

    async def stats(self) -> BackendStats:
        s = self.engine.stats()
        ranks = await self.engine.rank_stats()  # what the ranks' NIXL transfers moved
        return BackendStats("synthetic", num_blocks=s["num_blocks"], free_blocks=s["free_blocks"],
                            held_leases=s["held_requests"],
                            transfer_bytes=sum(r.get("bytes_posted", 0) for r in ranks),
                            handshakes=sum(r.get("handshakes", 0) for r in ranks), child_pids=tuple(s["rank_pids"]),
                            counters={"decoding": len(self._decoding), "rank_incarnation": s["incarnation"]})

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
