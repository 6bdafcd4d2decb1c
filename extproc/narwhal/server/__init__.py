"""I/O adapters: gRPC ext_proc, admin HTTP, engine health checks, process wiring."""
