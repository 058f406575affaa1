"""Model folders vLLM loads: the embedded SmolLM2, tiny test Llamas, local folders and hub ids (never downloaded by raypd)."""
