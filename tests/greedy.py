"""What "the same greedy answer" can mean on vLLM's CPU kernels, and a check that holds it.

vLLM promises a greedy stream token for token equal to another only where its kernels are
batch-invariant: the same engine settings and the same batch. The CPU kernels are not
batch-invariant: a stream that shares its steps with other streams (migrated ones joining
its batch, say) may see its logits move in the last bits, and where its two best tokens are
nearly tied the argmax can flip. From there on it is still a correct greedy continuation of
its own prefix, just not of the reference's.

`divergence` accepts exactly that, and keeps checking after it: the answer equals the
reference, or they first differ at a position where the reference's top-2 logprobs are within
`TIE_MARGIN` and the answer took the reference's runner-up; then what follows the split must
be the reference's greedy continuation of the accepted branch (the prompt plus the answer's
tokens up to and including the split), which the caller computes (`Continuation`: one more
greedy request, batch 1), checked the same way (a later near tie on the branch is accepted
the same way). Ask every reference for `logprobs=2` (`greedy_request`). Tests comparing one
request at a time on engines with the same settings (batch 1 both sides) keep exact equality
(`exact_divergence`): that is a condition under which greedy output is deterministic.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from actors.protocol.request import EngineRequest, Logprobs, SamplingSpec, TokenChunk

TIE_MARGIN = 0.05  # nats between the reference's best two tokens: a near tie that batch noise may flip
MAX_SPLITS = 16  # accepted near ties on one answer before it counts as wrong: each costs one more request

# (prefix token ids, how many tokens) -> the reference's greedy continuation of that prefix: its tokens
# and each position's top-2 logprobs (at most that many tokens; fewer where it stops at EOS)
Continuation = Callable[[list[int], int], Awaitable[tuple[list[int], Logprobs]]]


def greedy_request(request_id: str, token_ids: Sequence[int], max_tokens: int,
                   ignore_eos: bool = False) -> EngineRequest:
    """A greedy request that also returns each position's top-2 logprobs."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, flat_logprobs=True,  # flat: 3x cheaper on CPU
                        ignore_eos=ignore_eos)
    return EngineRequest(request_id, SamplingSpec(max_tokens=max_tokens, temperature=0.0, vllm_params=pickle.dumps(sp)),
                         prompt_token_ids=tuple(token_ids))


def logprobs_of(chunks: Sequence[TokenChunk]) -> Logprobs:
    return tuple(pos for c in chunks for pos in (c.logprobs or ()))


@dataclass(frozen=True)
class Comparison:
    """One answer against one reference: equal (neither set), wrong (`problem`), or split from it at an
    accepted near tie (`split`: the position of the answer's runner-up token)."""

    problem: str | None = None
    split: int | None = None


def exact_divergence(answer: Sequence[int], reference: Sequence[int], start: int = 0) -> str | None:
    """None when `answer` is `reference` token for token; otherwise where they first differ (positions
    counted from `start`: where `answer` begins in the whole answer)."""
    if list(answer) == list(reference):
        return None
    k = _first_difference(answer, reference)
    if k is None:
        return f"lengths differ: {start + len(answer)} vs {start + len(reference)} tokens, equal as far as both go"
    return f"first differs at token {start + k}: {answer[k]} vs {reference[k]}"


def _first_difference(answer: Sequence[int], reference: Sequence[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), None)


def compare(answer: Sequence[int], reference: Sequence[int], reference_logprobs: Logprobs,
            margin: float = TIE_MARGIN, start: int = 0) -> Comparison:
    """The first position where `answer` leaves `reference`, and whether it is an accepted near tie
    (positions counted from `start`, as in `exact_divergence`)."""
    problem = exact_divergence(answer, reference, start)
    if problem is None:
        return Comparison()
    k = _first_difference(answer, reference)
    if k is None:
        return Comparison(problem)
    at = start + k
    if k >= len(reference_logprobs):
        return Comparison(f"first differs at token {at}, and the reference has no logprobs there")
    top = sorted(reference_logprobs[k], key=lambda e: e.logprob, reverse=True)[:2]
    if len(top) < 2:
        return Comparison(f"first differs at token {at}; the reference has one logprob there")
    gap = top[0].logprob - top[1].logprob
    if gap > margin:
        return Comparison(f"first differs at token {at}, where the reference's best token led by {gap:.4f} > {margin}")
    if answer[k] != top[1].token_id:
        return Comparison(f"first differs at token {at} with {answer[k]}, neither of the reference's two best")
    return Comparison(split=k)


async def divergence(answer: Sequence[int], reference: Sequence[int], reference_logprobs: Logprobs,
                     prompt: Sequence[int], continuation: Continuation, margin: float = TIE_MARGIN,
                     max_splits: int = MAX_SPLITS) -> str | None:
    """None when `answer` is `reference`, or splits from it only at near ties and is, after each split,
    the reference's greedy continuation of the accepted branch; otherwise what is wrong."""
    answer = list(answer)
    total = len(reference)  # the answer's length: the reference's, whatever branch it took
    offset, splits = 0, []
    ref, lps = list(reference), reference_logprobs
    while True:
        found = compare(answer[offset:], ref, lps, margin, start=offset)
        if found.problem is not None:
            return found.problem + (f" (on the branch after the near-tie splits at {splits})" if splits else "")
        if found.split is None:
            return None
        splits.append(offset + found.split)
        if len(splits) > max_splits:
            return f"more than {max_splits} near-tie splits: {splits}"
        offset = splits[-1] + 1
        if offset >= total:  # split at the reference's last token: nothing follows
            return None if len(answer) == total else f"lengths differ: {len(answer)} vs {total} tokens"
        ref, lps = await continuation([*prompt, *answer[:offset]], total - offset)
        ref = list(ref)


async def alone(client, prompt_ids: Sequence[int], n: int) -> tuple[list[int], Logprobs]:
    """The greedy answer of one request alone on the engine behind `client` (an `EngineClient`: batch 1),
    with its top-2 logprobs: a reference, or a `Continuation` step."""
    req = greedy_request(f"ref-{time.monotonic_ns()}", prompt_ids, n, ignore_eos=True)
    chunks = [c async for c in client.generate(req)]
    return [t for c in chunks for t in c.token_ids], logprobs_of(chunks)
