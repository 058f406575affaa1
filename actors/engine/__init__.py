"""The engine actor: one prefill, decode or colocated engine as a Ray actor, with its backends (vLLM, synthetic)."""
