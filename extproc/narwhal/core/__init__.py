"""The sans-I/O core: plain, synchronous, typed protocol logic with no sockets or gRPC.

Everything here is fed bytes and events by the adapters in ``narwhal.server`` and
returns decisions and bytes, the way h11 and httpcore separate protocol from I/O.
"""
