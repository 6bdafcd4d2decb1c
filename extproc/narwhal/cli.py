"""The `narwhal` command: serve, sim, demo."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import Config, ConfigError, load
from .core.sizing import SizingError
from .sim.batching import BLOCK_SIZE, PROFILES, BatchScheduler, Intake, Profile, StepCost
from .sim.generate import FAULTS


def _config(path: str | None) -> Config:
    if path is None:
        return Config()
    return load(path)


def _batch_scheduler(args: argparse.Namespace) -> BatchScheduler:
    """The simulator's engine from --profile and the flags that override it."""
    base = PROFILES[args.profile] if args.profile else Profile(StepCost(), 65_536)
    cost = StepCost(
        base.cost.base_ms if args.tpot_ms is None else args.tpot_ms,
        base.cost.per_token_ms if args.prefill_tps is None else
        (1000.0 / args.prefill_tps if args.prefill_tps > 0 else 0.0),
        base.cost.per_ktok_ctx_ms if args.ctx_ms_per_ktok is None else args.ctx_ms_per_ktok)
    blocks = _given(args.num_gpu_blocks, base.num_gpu_blocks)
    budget = _given(args.max_num_batched_tokens, base.max_num_batched_tokens)
    seqs = _given(args.max_num_seqs, base.max_num_seqs)
    if min(blocks, budget, seqs) <= 0:
        raise ConfigError("--num-gpu-blocks, --max-num-batched-tokens and --max-num-seqs "
                          "must be positive")
    for name, value in (("--tpot-ms", cost.base_ms), ("--prefill-tps", cost.per_token_ms),
                        ("--ctx-ms-per-ktok", cost.per_ktok_ctx_ms)):
        if value < 0:
            raise ConfigError(f"{name} must not be negative")
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be positive")
    for name, value in (("--intake-ms", args.intake_ms),
                        ("--intake-us-per-token", args.intake_us_per_token)):
        if not 0 <= value < 1e6:
            raise ConfigError(f"{name} must be in [0, 1e6)")
    if blocks * BLOCK_SIZE < args.max_model_len:
        raise ConfigError(f"--num-gpu-blocks {blocks} x {BLOCK_SIZE} tokens cannot hold "
                          f"one --max-model-len {args.max_model_len} sequence (vLLM refuses "
                          "to start too)")
    return BatchScheduler(cost, budget, seqs, blocks,
                          prefix_caching=not args.no_enable_prefix_caching)


def _given(flag: int | None, default: int) -> int:
    return default if flag is None else flag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the ext_proc service and admin HTTP")
    p_serve.add_argument("--config", required=True, help="YAML configuration file")
    # One of serve's ext_proc workers (serving.workers): started by serve, not by hand.
    p_worker = sub.add_parser("worker")
    p_worker.add_argument("--config", required=True)
    p_worker.add_argument("--index", type=int, required=True)
    p_worker.add_argument("--fd", type=int, required=True)

    p_check = sub.add_parser("check-config", help="validate a configuration file and exit")
    p_check.add_argument("config")

    p_sim = sub.add_parser("sim", help="run a vLLM-compatible engine simulator")
    p_sim.add_argument("--host", default="127.0.0.1")
    p_sim.add_argument("--port", type=int, default=8001)
    p_sim.add_argument("--model", default="narwhal-sim")
    p_sim.add_argument("--dialect", choices=["vllm", "openai"], default="vllm")
    p_sim.add_argument("--profile", choices=sorted(PROFILES),
                       help="a GPU + model timing profile (the flags below override it)")
    p_sim.add_argument("--tpot-ms", type=float, default=None,
                       help="fixed milliseconds per engine step (0: instant)")
    p_sim.add_argument("--prefill-tps", type=float, default=None,
                       help="scheduled tokens per second of step compute (0: free)")
    p_sim.add_argument("--ctx-ms-per-ktok", type=float, default=None,
                       help="step milliseconds per 1000 tokens of context attended")
    p_sim.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget per step (vLLM's flag; 2048)")
    p_sim.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences running at once (vLLM's flag; 256)")
    p_sim.add_argument("--num-gpu-blocks", type=int, default=None,
                       help="KV-cache blocks of 16 tokens (65536)")
    p_sim.add_argument("--no-enable-prefix-caching", action="store_true",
                       help="turn automatic prefix caching off (vLLM's flag)")
    p_sim.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage reports the prompt's prefix-cache hit (vLLM's flag)")
    p_sim.add_argument("--natural-output", type=int, default=0,
                       help="median natural output length (the model stops by itself; "
                            "0: every request runs to max_tokens)")
    p_sim.add_argument("--engine-name", default="",
                       help="sent back in response header x-sim-engine (benchmarks)")
    p_sim.add_argument("--fault", default=None, choices=sorted(FAULTS),
                       help="an x-sim-fault for every request that names none (a broken engine)")
    p_sim.add_argument("--time-scale", type=float, default=1.0,
                       help="multiply every step's duration (run a GPU profile slower on "
                            "a small machine)")
    p_sim.add_argument("--intake-ms", type=float, default=Intake().ms,
                       help="milliseconds from a request's arrival to the scheduler, as vLLM's "
                            f"API server takes ({Intake().ms}, measured; scaled by --time-scale)")
    p_sim.add_argument("--intake-us-per-token", type=float, default=Intake().us_per_token,
                       help=f"intake microseconds per prompt token (tokenization; "
                            f"{Intake().us_per_token})")
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

            run(_config(args.config), args.config)
        elif args.command == "worker":
            from .server.workers import main as worker_main

            worker_main(_config(args.config), args.index, args.fd)
        elif args.command == "check-config":
            cfg = load(args.config)
            print(f"ok: model {cfg.serving.model}, {len(cfg.engines)} engine(s)")
        elif args.command == "sim":
            from .sim.generate import SimOptions
            from .sim.server import run as run_sim

            run_sim(args.host, args.port,
                    SimOptions(model=args.model, dialect=args.dialect, reasoning=args.reasoning,
                               max_model_len=args.max_model_len,
                               natural_output=args.natural_output,
                               engine_name=args.engine_name, fault=args.fault,
                               prompt_tokens_details=args.enable_prompt_tokens_details),
                    _batch_scheduler(args), args.slow_start_ms, args.time_scale,
                    Intake(args.intake_ms, args.intake_us_per_token))
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
