"""The synthetic engine behind an EngineActor: byte tokenizer, streamed 'generation'.

Text is tokenized as UTF-8 bytes (ids 0..255, shifted by 1000 so they never
collide with generated ids) and generated ids are rendered as short words, so
the HTTP front sees a real text stream. A decode whose KV fails verification
is an error, never an answer.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, AsyncIterator

from actors.engine_config import EngineConfig
from actors.synthetic.engine import EngineShape, SyntheticEngine, TransferFailed
from actors.synthetic.rank import SyntheticModel

TOKEN_OFFSET = 1000


def encode_text(text: str) -> list[int]:
    return [TOKEN_OFFSET + b for b in text.encode("utf-8")]


def render_token(token_id: int) -> str:
    return f" w{token_id % 997}"


def chat_to_text(messages: list[dict]) -> str:
    return "".join(f"<|{m.get('role', 'user')}|>{m.get('content', '')}\n" for m in messages) + "<|assistant|>"


class SyntheticBackend:
    def __init__(self, cfg: EngineConfig, engine_id: str, token_latency_s: float = 0.0):
        self.cfg, self.engine_id = cfg, engine_id
        m = cfg.synthetic
        self.model = SyntheticModel(model_id=m.model_id, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                                    head_size=m.head_size, is_mla=m.is_mla, vocab_size=m.vocab_size)
        self.shape = EngineShape(tp_size=cfg.tp_size, pp_size=cfg.pp_size, dcp_size=cfg.dcp_size,
                                 block_size=cfg.effective_block_size, num_blocks=cfg.num_blocks,
                                 layout="ND" if m.is_mla else cfg.layout)
        self.token_latency_s = token_latency_s
        self._faults = random.Random(0)
        self.engine: SyntheticEngine | None = None
        self._decoding: set[str] = set()

    async def start(self, coordinator: Any) -> dict:
        # Registration is done by the EngineActor (it adds itself as a liveness handle).
        self.engine = SyntheticEngine(self.engine_id, self.cfg.role, self.model, self.shape, coordinator,
                                      lease_ttl_s=self.cfg.lease_ttl_s, read_timeout_s=self.cfg.read_timeout_s,
                                      register=False)
        await self.engine.start()
        return {}

    def handshakes(self) -> list[bytes]:
        return list(self.engine.handshakes)

    def liveness_handles(self) -> list[Any]:
        return list(self.engine.ranks)

    def _tokens(self, req: dict) -> list[int]:
        if req.get("prompt_token_ids"):
            tokens = [int(t) for t in req["prompt_token_ids"]]
        elif req.get("messages"):
            tokens = encode_text(chat_to_text(req["messages"]))
        else:
            tokens = encode_text(req.get("prompt", ""))
        if not tokens:
            from actors.engine import EngineRequestError

            raise EngineRequestError("the prompt is empty")
        if len(tokens) + int(req.get("max_tokens", 16)) > self.cfg.max_model_len:
            from actors.engine import EngineRequestError

            raise EngineRequestError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.get('max_tokens', 16)}) exceeds "
                f"the context length {self.cfg.max_model_len}"
            )
        return tokens

    async def prefill(self, req: dict) -> dict:
        tokens = self._tokens(req)
        params = await self.engine.prefill(req["request_id"], tokens, seed=int(req.get("kv_seed", 0)))
        return {"kv_transfer_params": params, "num_prompt_tokens": len(tokens)}

    async def generate(self, req: dict) -> AsyncIterator[dict]:
        req_id = req["request_id"]
        tokens = self._tokens(req)
        max_tokens = int(req.get("max_tokens", 16))
        params = req.get("kv_transfer_params")
        if params and self.cfg.fault_rate and self._faults.random() < self.cfg.fault_rate:
            params = {**params, "inject_fault": True}  # fault-injection knob (tests)
        recomputed = False
        self._decoding.add(req_id)
        try:
            if params:
                try:
                    out = await self.engine.decode(req_id, params, tokens, seed=int(req.get("kv_seed", 0)),
                                                   max_tokens=max_tokens, timeout_s=self.cfg.read_timeout_s * 2)
                    if out["mismatches"]:
                        raise TransferFailed(req_id, [f"{out['mismatches']} KV elements failed verification"], set())
                except (TransferFailed, KeyError, TypeError, ValueError) as exc:
                    if self.cfg.kv_load_failure_policy == "fail":
                        yield {"request_id": req_id, "token_ids": [], "text": "", "finished": True,
                               "finish_reason": "error", "error": f"KV transfer failed: {exc}",
                               "num_prompt_tokens": len(tokens)}
                        return
                    out = await self.engine.generate_local(req_id, tokens, max_tokens=max_tokens)
                    recomputed = True
            else:
                out = await self.engine.generate_local(req_id, tokens, max_tokens=max_tokens)
            text_so_far = ""
            stops = [s for s in (req.get("stop") or []) if s]
            for i, tok in enumerate(out["token_ids"]):
                if self.token_latency_s:
                    await asyncio.sleep(self.token_latency_s)
                piece = render_token(tok)
                text_so_far += piece
                hit = next((s for s in stops if s in text_so_far), None)
                last = i == len(out["token_ids"]) - 1 or hit is not None
                yield {"request_id": req_id, "token_ids": [tok], "text": piece, "finished": last,
                       "finish_reason": ("stop" if hit else "length") if last else None,
                       "recomputed": recomputed, "num_prompt_tokens": len(tokens)}
                if hit:
                    return
        finally:
            self._decoding.discard(req_id)

    async def abort(self, req_id: str) -> None:
        await self.engine.abort(req_id)

    async def drop_engine(self, engine_id: str) -> None:
        return None  # the rank actors were told directly by the coordinator

    async def stats(self) -> dict:
        s = self.engine.stats()
        return {"free_blocks": s["free_blocks"], "num_blocks": s["num_blocks"],
                "held_leases": s["held_requests"], "decoding": len(self._decoding)}

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
