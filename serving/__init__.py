"""raypd serving: HTTP front, router, Ray Serve app builder, CLI, metrics, benchmarks."""
__version__ = "0.1.0"
