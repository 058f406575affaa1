"""vLLM behind the engine actor: the AsyncLLM backend, engine arguments, metrics, KV events, the KV connector."""
