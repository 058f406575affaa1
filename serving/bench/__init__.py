"""`raypd bench`: one load generator (SSE client, samples, percentiles, results writer) that benchmarks/ reuses."""
