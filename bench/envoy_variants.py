"""What Envoy itself costs beside an ext_proc processor, by Envoy config: the shipped
config, and the same with each of its extras taken out, in front of the compiled null
processor (``bench/null_extproc.c``), side by side with Envoy alone.

    python -m bench.envoy_variants [--duration S] [--reps N] [--connections C]
                                   [--variants shipped,nghttp2,...]

Why it exists: beside any processor, Envoy's own CPU per non-streaming request is ~4x
what it is alone (``bench.datapath``'s floor lines), which by itself holds the stack near
half of Envoy alone's throughput. This measures whether the shipped config's extras (the
access log of failed requests, the metadata forwarded to the processor, the retry policy
and the body it buffers for a retry, the local-reply mappers) are part of that cost, with
a processor cheap enough (a few us a request) not to blur the answer, and whether either
of Envoy's alternatives for the processor's connection is cheaper: its nghttp2 HTTP/2 codec
(oghttp2 is the default) or its Google gRPC client (its own Envoy gRPC client is shipped),
and whether what Envoy does once an ext_proc stream shrinks with two options that touch
it: the gRPC client's own ``x-envoy-*`` headers left off each stream
(``skip_envoy_headers``) and the route kept after Narwhal's header mutation
(``route_cache_action: RETAIN``; the route does not match on the destination header).
Envoy's own check refuses the one change that would cut messages: trailers cannot be skipped with
``FULL_DUPLEX_STREAMED`` bodies.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from bench import scratch
from bench.datapath import (
    MODEL,
    Route,
    engine_pid,
    envoy_alone,
    measure,
    null_path,
    report,
    rows_of,
)
from narwhal.launch import SimSpec, Stack


def connection_manager(cfg: dict) -> dict[str, Any]:
    """The shipped config's HTTP connection manager (its filters, route, access log)."""
    listener = cfg["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def ext_proc_filter(cfg: dict) -> dict[str, Any]:
    """The shipped config's ext_proc filter (its gRPC service, processing mode...)."""
    return connection_manager(cfg)["http_filters"][0]["typed_config"]


def _route(cfg: dict) -> dict[str, Any]:
    return connection_manager(cfg)["route_config"]["virtual_hosts"][0]["routes"][0]


def _no_access_log(cfg: dict) -> None:
    del connection_manager(cfg)["access_log"]


def _no_metadata(cfg: dict) -> None:
    del ext_proc_filter(cfg)["metadata_options"]


def _no_retry(cfg: dict) -> None:
    del _route(cfg)["route"]["retry_policy"]
    del _route(cfg)["per_request_buffer_limit_bytes"]


def _no_local_reply(cfg: dict) -> None:
    del connection_manager(cfg)["local_reply_config"]


def _nghttp2(cfg: dict) -> None:
    cfg["layered_runtime"] = {"layers": [{"name": "codec", "static_layer": {
        "envoy.reloadable_features.http2_use_oghttp2": False}}]}


def _google_grpc(cfg: dict) -> None:
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "narwhal")
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]
    target = (f"unix:{address['pipe']['path']}" if "pipe" in address else
              "{address}:{port_value}".format(**address["socket_address"]))
    ext_proc_filter(cfg)["grpc_service"] = {"google_grpc": {"target_uri": target,
                                                            "stat_prefix": "narwhal"}}


def _none(cfg: dict) -> None:
    for change in (_no_access_log, _no_metadata, _no_retry, _no_local_reply):
        change(cfg)


def _skip_envoy_headers(cfg: dict) -> None:
    ext_proc_filter(cfg)["grpc_service"]["envoy_grpc"]["skip_envoy_headers"] = True


def _retain_route(cfg: dict) -> None:
    ext_proc_filter(cfg)["route_cache_action"] = "RETAIN"


VARIANTS: dict[str, Callable[[dict], None] | None] = {
    "shipped": None, "no-access-log": _no_access_log, "no-metadata": _no_metadata,
    "no-retry": _no_retry, "no-local-reply": _no_local_reply, "none-of-them": _none,
    "nghttp2": _nghttp2, "google-grpc": _google_grpc,
    "skip-envoy-headers": _skip_envoy_headers, "retain-route": _retain_route}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per path (median reported)")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    body = {"model": MODEL, "max_tokens": 16, "stream": False,
            "messages": [{"role": "user", "content": "hello there"}]}
    sim = SimSpec("instant")
    paths: list[Route] = []
    with scratch("narwhal-envoy-variants-") as workdir:
        sims = Stack(sims=[dataclasses.replace(sim, port=0)], workdir=workdir).start_sims()
        try:
            paths.append(envoy_alone(sims.sims[0].port, workdir, engine_pid(sims)))
            for name in chosen:
                change = VARIANTS[name]
                paths.append(null_path(sim, workdir, compiled=True, envoy_change=change,
                                       name=name))
            measure(paths, body, args.connections, 1, args, workdir)
            rows = rows_of("non-streaming", "request", paths, 1)
        finally:
            for p in paths:
                p.stop()
            sims.stop()
    print("Envoy's own CPU beside the compiled null processor (its CPU in the narwhal "
          f"column), by Envoy config; medians of {args.reps} x {args.duration:g}s")
    print(f"reproduce: python -m bench.envoy_variants --duration {args.duration:g} "
          f"--reps {args.reps} --connections {args.connections} --variants {args.variants}")
    for line in report(rows):
        print(line)
    print("\next_proc messages a request (both ways, Envoy's count): " + ", ".join(
        f"{r.path} {r.messages:.1f}" for r in rows if r.messages))


if __name__ == "__main__":
    main()
