"""raypd serving: HTTP front, router, Ray Serve app builder, CLI, metrics, benchmarks."""
