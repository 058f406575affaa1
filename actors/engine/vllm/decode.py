"""The vLLM decode engine's `generate`: a colocated request, or one that resumes an answer.

A resumed request is the prompt plus the k tokens the client already has
(`EngineRequest.num_resumed_tokens`): k = 1 after a prefill on another engine, more for a migrated
stream. vLLM 0.32 has no way to hand a request output tokens, so those k tokens are prompt here;
what one engine would have seen differently (penalties, min_tokens, seeded draws, stop strings,
logprobs) is corrected around vLLM, and the few parameters that cannot be replay the k-th token
instead. The first chunk the client sees carries how the KV arrived (`PullVerdict`). A colocated
request (k = 0, no transfer params) is vLLM's own stream, unchanged. The life cycle of a resumed
request: `DecodePath`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.decode_caps import SAMPLING_EPS, DecodeCaps, replay_reason
from actors.engine.vllm.requests import base_params, engine_outputs, logprobs_of, prompt_ids, stream_params
from actors.engine.vllm.resumed import PENALTIES_KEY, RESUMED_KEY, SKIP_DRAWS_KEY
from actors.kv.transfer_errors import HandshakeError
from actors.protocol.request import EngineRequest, TokenChunk
from actors.transfer_params import TransferParams

if TYPE_CHECKING:  # vLLM's own types, for the annotations only (this module imports vLLM lazily)
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.outputs import RequestOutput
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("raypd.vllm")


def decode_caps(vllm_config: VllmConfig) -> DecodeCaps:
    """What this engine, as vLLM configured it, offers a resumed request."""
    from actors.engine.vllm.resumed import QUALNAME, resume_support

    support = resume_support(vllm_config)
    names = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}"
             for p in (vllm_config.model_config.logits_processors or ())]
    return DecodeCaps(penalties=support["penalties"], seed_advance=support["seed_advance"],
                      custom_processors=any(n != QUALNAME for n in names),
                      watermark=getattr(vllm_config, "watermark_config", None) is not None)


def redraw_is_exact(sp: SamplingParams) -> bool:
    """Whether replaying a token draws it again: greedy, or seeded (a fresh generator)."""
    return sp.temperature < SAMPLING_EPS or sp.seed is not None


def needs_own_text(sp: SamplingParams) -> bool:
    """Stop strings a resumed request's text must be checked for across the resumed tokens (a
    one-character stop string lies within one token's text, and is never held back)."""
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    return any(len(s) > 1 for s in stop)


def held_chars(sp: SamplingParams) -> int:
    """vLLM's stop-string buffer: what a DELTA stream holds back while it goes on."""
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    return max(len(s) for s in stop) - 1 if stop and not sp.include_stop_str_in_output else 0


def resumed_params(sp: SamplingParams, k: int, max_tokens: int, caps: DecodeCaps) -> SamplingParams:
    """The decode request's params for prompt + k (no replay), from the request's own `sp`."""
    sp.max_tokens = max_tokens
    sp.min_tokens = min(max(0, sp.min_tokens - k), max_tokens)
    extra = dict(sp.extra_args or {})
    if (sp.presence_penalty or sp.frequency_penalty) and caps.penalties:
        extra[PENALTIES_KEY] = [sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty]
        extra[RESUMED_KEY] = k
        sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty = 0.0, 0.0, 1.0
    if sp.seed is not None and sp.temperature >= SAMPLING_EPS and caps.seed_advance:
        extra[SKIP_DRAWS_KEY] = k
    sp.extra_args = extra or None
    return sp


def without_prompt_logprobs(sp: SamplingParams) -> SamplingParams:
    """The prefill engine returned them; asking again would also make vLLM skip the prefix cache
    and the connector (`skip_reading_prefix_cache`, resolved when the params were built)."""
    sp.prompt_logprobs = None
    sp.prompt_logprob_token_ids = None
    sp.skip_reading_prefix_cache = False
    return sp


class ResumedText:
    """vLLM's own incremental detokenizer as one engine runs it: over the original prompt, fed the
    resumed tokens first (their text, less the held-back tail, reached the client already)."""

    def __init__(self, tokenizer: TokenizerLike | None, prompt: list[int], resumed: list[int], sp: SamplingParams):
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        req = EngineCoreRequest(request_id="raypd-text", prompt_token_ids=list(prompt), mm_features=None,
                                sampling_params=sp, pooling_params=None, arrival_time=0.0, lora_request=None,
                                cache_salt=None, data_parallel_rank=None)
        self.detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
        self.detok.update(list(resumed), False)
        self.detok.get_next_output_text(False, True)

    def feed(self, tokens: tuple[int, ...], finished: bool, stop_terminated: bool
             ) -> tuple[tuple[int, ...], str, str | None]:
        """(the tokens one engine keeps, the text it streams, the stop string it found)."""
        before = self.detok.num_output_tokens()
        stop = self.detok.update(list(tokens), stop_terminated)
        kept = tuple(self.detok.output_token_ids[before:])
        return kept, self.detok.get_next_output_text(finished or stop is not None, True), stop


@dataclass(frozen=True)
class PullVerdict:
    """How a decode request's prompt KV arrived, as vLLM's first delta tells it."""

    num_cached_tokens: int  # prompt tokens vLLM did not compute (pulled, or in its prefix cache)
    recomputed: bool  # the pull failed and the prompt was computed here (policy recompute)

    def on(self, chunk: TokenChunk) -> TokenChunk:
        return chunk.replace(num_cached_tokens=self.num_cached_tokens, recomputed=self.recomputed)


@dataclass(frozen=True)
class DecodeWiring:
    """All `DecodePath` uses of its backend, handed over when the engine runs: the engine, the
    counters the backend reports, and calls into the backend's peers and ledger (looked up at
    each call: the backend's coordinator changes when the coordinator restarts)."""

    engine_id: str
    llm: AsyncLLM
    max_model_len: int
    kv_load_failure_policy: str  # "fail": a failed pull ends the request; else the prompt is recomputed
    counters: dict[str, int]  # the backend's, shared: its stats() report them
    attach: Callable[[TransferParams], Awaitable[dict]]  # the params for vLLM's connector; raises HandshakeError
    report_pull: Callable[[str, bool], None]  # (request id, failed): one pulled request's outcome to the ledger
    handshake_failed: Callable[[str, str, str], None]  # (prefill engine, reason, request id) to the ledger


class DecodePath:
    """`VllmBackend.generate`, with the engine, peers, counters and ledger its `DecodeWiring` gives.

    Life cycle of a resumed request:

      1. plan      `replay_reason`: nearly every parameter continues from prompt + k
                   (the table in the README, "Sampling parameters and the first-token
                   replay"); the few whose state only vLLM's own sampled outputs can
                   feed (structured outputs, thinking budget, repetition detection,
                   multi-token bad words, or what this engine lacks: `DecodeCaps`)
                   replay the k-th token instead (k = 1 only, and only when the redraw
                   is exact: greedy or seeded; the front seeds what may need it);
      2. params    `resumed_params`: max_tokens is what is left, min_tokens less k,
                   presence/frequency/repetition penalties move to raypd's
                   `ResumedPenalties` (the k tokens count as outputs), a seeded
                   generator is advanced by k draws (`actors.engine.vllm.resumed`),
                   prompt_logprobs are dropped (the prefill engine returned them) and
                   the prefix cache is read again (vLLM skips it, and the pull, when
                   prompt_logprobs are asked for);
      3. pull      with transfer params the connector pulls the KV of every prompt
                   token (synchronously for small pulls: `sync_load_max_tokens`);
                   the first scheduled step computes only the resumed token and
                   samples the next one;
      4. verdict   the first delta says how the KV arrived (`PullVerdict`): the
                   ledger hears it, the first chunk the client sees carries it;
      5. text      with stop strings of two or more characters (or a replay),
                   `ResumedText` detokenizes as one engine would: vLLM's incremental
                   detokenizer over the original prompt, fed the k tokens first, so a
                   stop string that begins in them is found and the text one engine
                   holds back (`PrefillResult.held_chars`) is streamed exactly once;
      6. stream    one chunk per vLLM delta; logprobs as vLLM returns them (the
                   first token's came with the prefill), the cumulative logprob
                   continued from `EngineRequest.resumed_logprob`.

    A colocated request (k = 0, no transfer params) is vLLM's own stream, unchanged.
    """

    def __init__(self, wiring: DecodeWiring, caps: DecodeCaps):
        self.w, self.caps = wiring, caps
        self._aliases: dict[str, str] = {}  # request id -> the id of its continuation after a replay mismatch
        logger.info("%s: resumed requests: %s", wiring.engine_id, caps)

    def vllm_ids(self, req_id: str) -> list[str]:
        """The ids vLLM may run request `req_id` under (its continuation's too): what an abort names."""
        return list({req_id, self._aliases.get(req_id, req_id)})

    async def generate(self, req: EngineRequest, params: TransferParams | None) -> AsyncIterator[TokenChunk]:
        w = self.w
        ids = prompt_ids(req, w.max_model_len)
        k = req.num_resumed_tokens if 0 < req.num_resumed_tokens < len(ids) else 0
        sp = base_params(req.sampling)
        reason = replay_reason(self._tokenized(sp), self.caps) if k else None
        replay = k == 1 and reason is not None and redraw_is_exact(sp)
        if reason is not None:
            w.counters["replays" if replay else "inexact_resumes"] += 1
            logger.debug("%s: %s (%s)", req.request_id, "replay" if replay else "no exact replay", reason)
        engine_ids = ids[:-1] if replay else ids
        num_prompt = len(ids) - req.num_resumed_tokens
        kv_params, handshake_failed, expected = None, False, 0
        if params is not None:
            try:
                kv_params = await w.attach(params)
            except HandshakeError as exc:
                # the pull cannot even start: the ledger hears it as this pair's handshake failure,
                # and the policy decides as for any failed pull
                logger.warning("%s: handshake with %s failed: %s", req.request_id, params.remote_engine_id, exc)
                w.handshake_failed(params.remote_engine_id, str(exc), req.request_id)
                w.counters["kv_failures"] += 1
                if w.kv_load_failure_policy == "fail":
                    yield TokenChunk.error_chunk(req.request_id, f"KV transfer failed: {exc}", num_prompt)
                    return
                handshake_failed = True
            else:
                expected = min(params.num_tokens, len(engine_ids) - 1)
                w.counters["kv_pulls"] += 1
        if k:
            sp = without_prompt_logprobs(sp)
        if replay:
            sp.max_tokens, sp.min_tokens = req.max_tokens + 1, min(sp.min_tokens, req.max_tokens + 1)
        elif k:
            sp = resumed_params(sp, k, req.max_tokens, self.caps)
        else:
            sp.max_tokens, sp.min_tokens = req.max_tokens, min(sp.min_tokens, req.max_tokens)
        text = self._text(req, ids, k) if replay or (k and needs_own_text(base_params(req.sampling))) else None
        verdict: PullVerdict | None = None
        pending: PullVerdict | None = None  # put on the first chunk the client sees
        async for chunk, out in self._stream(req, engine_ids, stream_params(sp, kv_params), text, num_prompt,
                                             offset=None if replay else req.resumed_logprob, replayed=replay):
            if verdict is None:
                # vLLM reports cached tokens on the first delta: fewer than we pulled means
                # the pull failed and the prompt was recomputed (kv_load_failure_policy=recompute).
                error = chunk.failed
                cached = out.num_cached_tokens or 0
                recomputed = handshake_failed or bool(kv_params and cached < expected and out.outputs[0].token_ids)
                verdict = pending = PullVerdict(cached, recomputed)
                if recomputed:
                    w.counters["recomputed"] += 1
                if kv_params:
                    w.report_pull(req.request_id, recomputed or error)
                first = tuple(out.outputs[0].token_ids[:1])
                if replay and not error and first != tuple(ids[-1:]):
                    # the replay drew another token: go on from the streamed one (its KV is cached now)
                    w.counters["replay_mismatches"] += 1
                    logger.info("%s: replay drew %s instead of %s; continuing from the streamed token",
                                req.request_id, first, ids[-1:])
                    await w.llm.abort(req.request_id)
                    async for cont in self._continue_after(req, ids, num_prompt, verdict):
                        yield cont
                    return
            if not (chunk.token_ids or chunk.text or chunk.finished):
                continue  # nothing for the client (the replayed token alone)
            if pending is not None:
                chunk, pending = pending.on(chunk), None
            if chunk.failed:
                w.counters["kv_failures"] += 1
                chunk = chunk.replace(error="KV transfer failed (kv_load_failure_policy=fail)")
            yield chunk

    def _tokenized(self, sp: SamplingParams) -> SamplingParams:
        if sp.bad_words and getattr(sp, "_bad_words_token_ids", None) is None:
            sp.update_from_tokenizer(self.w.llm.tokenizer)  # which bad words span tokens
        return sp

    def _text(self, req: EngineRequest, ids: list[int], k: int) -> ResumedText:
        return ResumedText(self.w.llm.tokenizer, ids[:-k], ids[-k:], base_params(req.sampling))

    async def _stream(self, req: EngineRequest, engine_ids: list[int], sp: SamplingParams, text: ResumedText | None,
                      num_prompt: int, offset: float | None, replayed: bool = False,
                      vllm_id: str | None = None) -> AsyncIterator[tuple[TokenChunk, RequestOutput]]:
        """vLLM's deltas as chunks: the replayed token dropped (also when vLLM merged it with the
        next step's), text from `text` when given, the cumulative logprob continued from `offset`."""
        vllm_id = vllm_id or req.request_id
        first = True
        async for out in engine_outputs(self.w.llm, engine_ids, sp, vllm_id):
            o = out.outputs[0]
            tokens, lps = tuple(o.token_ids), logprobs_of(o.logprobs)
            if first and replayed and tokens[:1] == tuple(req.prompt_token_ids[-1:]):
                tokens, lps = tokens[1:], lps[1:] if lps is not None else None  # the client has it
            first = False
            finished = out.finished
            reason = str(o.finish_reason) if o.finish_reason is not None else ("stop" if finished else None)
            piece = o.text
            if text is not None:
                stop_terminated = finished and reason == "stop" and not isinstance(o.stop_reason, str)
                kept, piece, stop = text.feed(tokens, finished, stop_terminated)
                tokens, lps = kept, lps[:len(kept)] if lps is not None else None
                if stop is not None and not finished:  # begun in a resumed token: vLLM could not see it
                    finished, reason = True, "stop"
                    await self.w.llm.abort(vllm_id)
            cumulative = o.cumulative_logprob
            if cumulative is not None and offset is not None:
                cumulative += offset
            chunk = TokenChunk(req.request_id, tokens, piece, finished=finished, finish_reason=reason,
                               num_prompt_tokens=num_prompt, logprobs=lps, cumulative_logprob=cumulative)
            yield chunk, out
            if finished:
                return

    async def _continue_after(self, req: EngineRequest, ids: list[int], num_prompt: int,
                              verdict: PullVerdict) -> AsyncIterator[TokenChunk]:
        """Generate after prompt + the streamed token(s), as a resumed request (no pull)."""
        cont_id = f"{req.request_id}-cont"
        self._aliases[req.request_id] = cont_id
        k = req.num_resumed_tokens
        sp = resumed_params(without_prompt_logprobs(base_params(req.sampling)), k, req.max_tokens, self.caps)
        text = self._text(req, ids, k) if needs_own_text(base_params(req.sampling)) else None
        pending: PullVerdict | None = verdict
        try:
            async for chunk, _ in self._stream(req, ids, stream_params(sp, None), text, num_prompt,
                                               req.resumed_logprob, vllm_id=cont_id):
                if pending is not None:
                    chunk, pending = pending.on(chunk), None
                yield chunk
        finally:
            self._aliases.pop(req.request_id, None)
