"""A vLLM-compatible engine simulator: the stand-in engine for demos, tests and benchmarks."""
