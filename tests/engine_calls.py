"""Calling EngineActors directly the way the router does (typed requests, the first-token continuation)."""

from __future__ import annotations

from actors.protocol.request import EngineRequest, PrefillResult, SamplingSpec, TokenChunk
from actors.engine.synthetic.tokenizer import encode_text


def request(request_id: str, prompt: str | None = None, max_tokens: int = 16, token_ids=None,
            **changes) -> EngineRequest:
    """A text prompt is tokenized as the front does for the synthetic model (UTF-8 bytes)."""
    ids = tuple(token_ids) if token_ids is not None else tuple(encode_text(prompt or ""))
    return EngineRequest(request_id, SamplingSpec(max_tokens=max_tokens), prompt_token_ids=ids, **changes)


async def collect(actor, req: EngineRequest) -> list[TokenChunk]:
    return [await ref async for ref in actor.generate.options(num_returns="streaming").remote(req)]


async def pd(prefill, decode, req: EngineRequest) -> tuple[PrefillResult, list[TokenChunk]]:
    """Prefill on one engine, continue on the other: (prefill result, the decode engine's chunks)."""
    pre = await prefill.prefill.remote(req)
    if not pre.needs_decode:
        return pre, []
    return pre, await collect(decode, pre.continuation(req))


def token_ids(pre: PrefillResult, chunks: list[TokenChunk]) -> list[int]:
    """The whole answer: the prefill engine's first token(s), then the decode engine's."""
    return list(pre.first_token_ids) + [t for c in chunks for t in c.token_ids]
