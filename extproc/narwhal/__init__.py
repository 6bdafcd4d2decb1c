"""Narwhal: an admission-controlling, SLO-aware router for LLM inference engines.

It runs as an Envoy external processor (ext_proc). The package is laid out like the
architecture: ``core`` is the sans-I/O protocol logic, ``server`` the thin adapters
that feed it from gRPC and HTTP, ``sim`` the vLLM-compatible engine simulator.
"""

__version__ = "0.1.0"
