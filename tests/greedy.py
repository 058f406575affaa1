"""What "the same greedy answer" can mean on vLLM's CPU kernels, and a check that holds it.

vLLM promises a greedy stream token for token equal to another only where its kernels are
batch-invariant: the same engine settings and the same batch. The CPU kernels are not
batch-invariant: a stream that shares its steps with other streams (migrated ones joining
its batch, say) may see its logits move in the last bits, and where its two best tokens are
nearly tied the argmax can flip. From there on it is still a correct greedy continuation of
its own prefix, just not of the reference's.

`assert_greedy_continuation` accepts exactly that: the answer equals the reference, or they
first differ at a position where the reference's top-2 logprobs are within `TIE_MARGIN` and
the answer took the reference's runner-up. Ask the reference for `logprobs=2`
(`greedy_request`). Tests comparing one request at a time on engines with the same settings
(batch 1 both sides) keep exact equality: that is a condition under which greedy output is
deterministic.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

from actors.protocol.request import EngineRequest, Logprobs, SamplingSpec, TokenChunk

TIE_MARGIN = 0.05  # nats between the reference's best two tokens: a near tie that batch noise may flip


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


def divergence(answer: Sequence[int], reference: Sequence[int], reference_logprobs: Logprobs,
               margin: float = TIE_MARGIN) -> str | None:
    """None when `answer` is `reference` or a greedy continuation of it that split at a near tie;
    otherwise what is wrong."""
    if list(answer) == list(reference):
        return None
    k = next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), None)
    if k is None:
        return f"lengths differ: {len(answer)} vs {len(reference)} tokens, equal as far as both go"
    if k >= len(reference_logprobs):
        return f"first differs at token {k}, and the reference has no logprobs there"
    top = sorted(reference_logprobs[k], key=lambda e: e.logprob, reverse=True)[:2]
    if len(top) < 2:
        return f"first differs at token {k}; the reference has one logprob there"
    gap = top[0].logprob - top[1].logprob
    if gap > margin:
        return f"first differs at token {k}, where the reference's best token led by {gap:.4f} > {margin}"
    if answer[k] != top[1].token_id:
        return f"first differs at token {k} with {answer[k]}, neither of the reference's two best"
    return None


def assert_greedy_continuation(answer: Sequence[int], reference: Sequence[int], reference_logprobs: Logprobs,
                               margin: float = TIE_MARGIN) -> None:
    problem = divergence(answer, reference, reference_logprobs, margin)
    assert problem is None, problem
