"""Worker-side pieces that let a decode engine continue from prompt + the tokens the client has.

vLLM 0.32 cannot be handed output tokens: a resumed request (prompt + k tokens already generated,
`EngineRequest.num_resumed_tokens`) reaches the model runner with those k tokens as prompt. Two
sampler states would see them wrongly; both are corrected here, in the worker process (vLLM loads
this module there by name), so the decode engine samples the (k+1)-th token exactly as one engine
would, without replaying the k-th: penalties (`ResumedPenalties`, a V1 logits processor applying
vLLM's own `apply_penalties` with the last k prompt tokens counted as outputs, in the pipeline's
order) and seeded generators (`install_generator_hooks`). The decode backend decides from
`resume_support` whether a parameter can skip the replay; when not, it replays
(`actors.engine.vllm.decode`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

logger = logging.getLogger("raypd.resumed")

QUALNAME = "actors.engine.vllm.resumed:ResumedPenalties"  # vLLM loads "<module>:<type>"
PENALTIES_KEY = "raypd_penalties"  # extra_args: [presence, frequency, repetition]
RESUMED_KEY = "raypd_resumed"  # extra_args: k, the resumed tokens at the end of the prompt
SKIP_DRAWS_KEY = "raypd_skip_draws"  # extra_args: sampler draws the prefill engine made


def resumed_state(params: Any, prompt: list[int] | None, out: list[int]) -> tuple | None:
    """A row's penalty state: (original prompt tensor, resumed tokens, live outputs, penalties)."""
    extra = params.extra_args or {}
    penalties = extra.get(PENALTIES_KEY)
    k = int(extra.get(RESUMED_KEY, 0))
    if not penalties or prompt is None or not 0 < k <= len(prompt):
        return None
    return (torch.tensor([list(prompt[:-k])], dtype=torch.int64), list(prompt[-k:]), out,
            tuple(float(p) for p in penalties))


def apply_batch_update(rows: dict[int, Any], bu: BatchUpdate | None, state=resumed_state) -> None:
    """Keep `rows` (batch index -> state) in step with the persistent batch, in the order
    vLLM's interface prescribes: removed, added, moved (one-way moves and swaps)."""
    if bu is None:
        return
    for index in bu.removed:
        rows.pop(index, None)
    for index, params, prompt, out in bu.added:
        st = state(params, prompt, out)
        if st is None:
            rows.pop(index, None)
        else:
            rows[index] = st
    for a, b, direction in bu.moved:
        va, vb = rows.pop(a, None), rows.pop(b, None)
        if va is not None:
            rows[b] = va
        if vb is not None and direction == MoveDirectionality.SWAP:
            rows[a] = vb


class ResumedPenalties(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple] = {}
        install_generator_hooks(vllm_config)

    def is_argmax_invariant(self) -> bool:
        return False  # penalties change greedy choices

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.rows, batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        from vllm.model_executor.layers.utils import apply_penalties

        dev = logits.device
        for i, (prompt, prior, out, (pres, freq, rep)) in self.rows.items():
            apply_penalties(logits[i:i + 1], prompt.to(dev),
                            torch.tensor([prior + list(out)], dtype=torch.int64, device=dev),
                            torch.tensor([pres], device=dev), torch.tensor([freq], device=dev),
                            torch.tensor([rep], device=dev))
        return logits


# ------------------------------------------------------------------ generators
def _draw(gen: torch.Generator) -> None:
    torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)  # forward_cpu's per-step draw


def cpu_sampler_draws_once() -> bool:
    """Whether vLLM's CPU sampler consumes exactly one `_draw` of a request's generator per
    sampled step (checked by running it, so a vLLM that samples otherwise is noticed)."""
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C (fused_gumbel_argmax)
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        sampler = TopKTopPSampler()
        if getattr(sampler.forward, "__func__", None) is not TopKTopPSampler.forward_cpu:
            return False
        gen, ref = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(1234)
        sampler.forward(torch.randn(2, 64), {0: gen}, None, None)
        _draw(ref)
        return bool(torch.equal(gen.get_state(), ref.get_state()))
    except Exception as exc:  # noqa: BLE001 - any surprise: no advance, the replay is used
        logger.info("raypd: the CPU sampler check failed (%s): seeded requests replay", exc)
        return False


def resume_support(vllm_config: Any) -> dict[str, bool]:
    """What a resumed request may rely on in this engine: `penalties` (ResumedPenalties is
    registered and runs) and `seed_advance` (the generator hook is installed and exact)."""
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    registered = any((p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}") == QUALNAME
                     for p in (mc.logits_processors or ()))
    v1 = not getattr(vllm_config, "use_v2_model_runner", False) and vllm_config.speculative_config is None
    seeded = (current_platform.is_cpu() and v1 and not getattr(mc, "use_fp64_gumbel", False)
              and cpu_sampler_draws_once())
    return {"penalties": registered and v1, "seed_advance": seeded}


_installed: dict[str, bool] = {}


def install_generator_hooks(vllm_config: Any) -> None:
    """Patch the V1 model runner once per process (CPU only):

    - a new request whose `extra_args` say `raypd_skip_draws: k` has its seeded generator advanced
      by the k draws the prefill engine's sampler made (CPU `forward_cpu`: one `randint` per
      sampled step); only installed when `cpu_sampler_draws_once` proves that draw;
    - rows whose sample vLLM discards (a chunk of a prompt) are sampled without their generator,
      so vLLM's rewind (`set_offset`, which a CPU generator refuses with "CPU Generator does not
      use offset", killing the engine) has nothing to rewind: the same stream as vLLM's rewind on
      CUDA.
    """
    from vllm.platforms import current_platform

    if _installed or not current_platform.is_cpu() or getattr(vllm_config, "use_v2_model_runner", False):
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _installed["park"] = _hook_sample_tokens(GPUModelRunner)
    if resume_support(vllm_config)["seed_advance"]:
        _installed["advance"] = _hook_update_states(GPUModelRunner)
    logger.info("raypd generator hooks: %s", _installed)


def _hook_update_states(cls: Any) -> bool:
    orig = getattr(cls, "_update_states", None)
    if orig is None:
        return False

    def _update_states(self, scheduler_output):
        result = orig(self, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            sp = new.sampling_params
            k = int((sp.extra_args or {}).get(SKIP_DRAWS_KEY, 0)) if sp is not None else 0
            state = self.requests.get(new.req_id) if k else None
            if state is not None and state.generator is not None:
                for _ in range(k):
                    _draw(state.generator)
        return result

    cls._update_states = _update_states
    return True


def _hook_sample_tokens(cls: Any) -> bool:
    orig = getattr(cls, "sample_tokens", None)
    if orig is None:
        return False

    def sample_tokens(self, *args, **kwargs):
        mask = getattr(self, "discard_request_mask", None)
        batch = getattr(self, "input_batch", None)
        gens = getattr(batch, "generators", None)
        parked: dict[int, torch.Generator] = {}
        if mask is not None and gens:
            for i in mask.np[:batch.num_reqs].nonzero()[0]:
                gen = gens.pop(int(i), None)
                if gen is not None:
                    parked[int(i)] = gen
        try:
            return orig(self, *args, **kwargs)
        finally:
            if parked:
                gens.update(parked)

    cls.sample_tokens = sample_tokens
    return True
