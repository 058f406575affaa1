"""Near ties of benchmarks/faults.py: is a mismatching answer a split at a near tie, or wrong?

CPU kernels are not batch-invariant: under load a greedy answer may leave the batch-1 reference
where the reference's top two tokens are nearly equal. raypd refuses `logprobs`, so the gap is
computed after the run, with the set-up's model in Hugging Face transformers (float32, CPU):
the reference's text is re-tokenized, the first reference token the answer does not match is
found, and the gap between the top two log-probabilities of the next token after the prompt
and the reference's tokens before it is taken. A gap <= NEAR_TIE_NATS is a near tie.
(transformers' numerics are not vLLM's: the gap is an estimate of the one the engine saw.)
"""

from __future__ import annotations

NEAR_TIE_NATS = 0.05


def divergence_token(token_texts: list[str], other: str) -> int | None:
    """The index of the first reference token (by its text) that `other` does not carry at its
    offset; None when `other` carries every one of them."""
    pos = 0
    for k, t in enumerate(token_texts):
        if other[pos:pos + len(t)] != t:
            return k
        pos += len(t)
    return None


class TieJudge:
    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()

    def gap(self, prompt: list[int], reference: str, other: str) -> float | None:
        """The top-two gap (nats) at the first differing token; None when no token differs."""
        ids = self.tok.encode(reference, add_special_tokens=False)
        texts, prev = [], ""
        for i in range(len(ids)):
            cur = self.tok.decode(ids[:i + 1])
            texts.append(cur[len(prev):])
            prev = cur
        k = divergence_token(texts, other)
        if k is None:
            return None
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([prompt + ids[:k]])).logits[0, -1]
        top = self.torch.log_softmax(logits, -1).topk(2).values
        return round(float(top[0] - top[1]), 5)
