"""The synthetic engine backend: rank actors with real, NIXL-registered KV caches and no model.

Prefill writes deterministic values into the KV cache; decode pulls them with
the same transport code the vLLM connector uses, verifies every element and
emits tokens derived from what it read, so a corrupted transfer changes the
output.
"""
