"""The pieces of benchmarks/pd_vs_vllm.py: set-ups (raypd, plain vLLM, NixlConnector, Ray Serve LLM), the load client, process CPU, statistics, the report."""
