"""The `narwhal` command: serve, sim, demo."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import Config, ConfigError, load
from .core.sizing import SizingError


def _config(path: str | None) -> Config:
    if path is None:
        return Config()
    return load(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the ext_proc service and admin HTTP")
    p_serve.add_argument("--config", required=True, help="YAML configuration file")

    p_check = sub.add_parser("check-config", help="validate a configuration file and exit")
    p_check.add_argument("config")

    p_sim = sub.add_parser("sim", help="run a vLLM-compatible engine simulator")
    p_sim.add_argument("--host", default="127.0.0.1")
    p_sim.add_argument("--port", type=int, default=8001)
    p_sim.add_argument("--model", default="narwhal-sim")
    p_sim.add_argument("--dialect", choices=["vllm", "openai"], default="vllm")
    p_sim.add_argument("--prefill-tps", type=float, default=0.0,
                       help="prompt tokens per second (0: instant prefill)")
    p_sim.add_argument("--tpot-ms", type=float, default=0.0,
                       help="milliseconds per output token at batch 1 (0: instant)")
    p_sim.add_argument("--max-num-seqs", type=int, default=256)
    p_sim.add_argument("--batch-slowdown", type=float, default=0.0,
                       help="TPOT grows by this fraction per extra running sequence")
    p_sim.add_argument("--slow-start-ms", type=float, default=1500.0,
                       help="first-token delay added by x-sim-fault: slow-start")
    p_sim.add_argument("--reasoning", choices=["none", "reasoning", "reasoning_content", "both"],
                       default="none",
                       help="emit reasoning as vLLM 0.32 does ('reasoning'), or in the older "
                            "'reasoning_content' field, or both")
    p_sim.add_argument("--max-model-len", type=int, default=32768,
                       help="context length: longer prompt + max_tokens is refused, as by vLLM")

    sub.add_parser("envoy-config", help="print the Envoy configuration Narwhal ships "
                                        "(client :8080, ext_proc at 127.0.0.1:9002)")

    p_demo = sub.add_parser("demo", help="Envoy + narwhal serve + simulated engines on loopback")
    p_demo.add_argument("--config", help="YAML configuration (engines default to simulators)")
    p_demo.add_argument("--port", type=int, default=8080, help="Envoy's client port")
    p_demo.add_argument("--engines", type=int, default=2, help="simulated engines to start")

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            from .server.app import run

            run(_config(args.config))
        elif args.command == "check-config":
            cfg = load(args.config)
            print(f"ok: model {cfg.serving.model}, {len(cfg.engines)} engine(s)")
        elif args.command == "sim":
            from .sim.generate import SimOptions
            from .sim.server import Timing
            from .sim.server import run as run_sim

            run_sim(args.host, args.port,
                    SimOptions(model=args.model, dialect=args.dialect, reasoning=args.reasoning,
                               max_model_len=args.max_model_len),
                    Timing(prefill_tps=args.prefill_tps, tpot_ms=args.tpot_ms,
                           max_num_seqs=args.max_num_seqs, batch_slowdown=args.batch_slowdown,
                           slow_start_ms=args.slow_start_ms))
        elif args.command == "envoy-config":
            from .launch import ENVOY_CONFIG

            sys.stdout.write(ENVOY_CONFIG.read_text())
        elif args.command == "demo":
            from .demo import run_demo

            return run_demo(args.config, args.port, args.engines)
    except (ConfigError, SizingError) as exc:
        print(f"narwhal: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
