"""`narwhal demo`: the whole data path on loopback, for a first `curl`."""

from __future__ import annotations

import signal
import threading

from .config import load
from .launch import LaunchError, SimSpec, Stack


def run_demo(config_path: str | None, port: int, engines: int) -> int:
    config: dict = {}
    model = "narwhal-sim"
    if config_path is not None:
        cfg = load(config_path)  # validate first: clear errors before any process starts
        from pathlib import Path

        import yaml

        config = yaml.safe_load(Path(config_path).read_text()) or {}
        model = cfg.serving.model
        config.pop("engines", None)  # the demo's engines are its simulators
    dialects = ["vllm", "openai"]
    sims = [SimSpec(name=f"sim-{chr(ord('a') + i)}", dialect=dialects[i % 2] if engines > 1
                    else "vllm", args=["--tpot-ms", "20", "--prefill-tps", "20000"])
            for i in range(engines)]
    stack = Stack(sims=sims, config=config, port=port, admin_port=9090, extproc_port=9002,
                  envoy_admin_port=9901, model=model)
    try:
        stack.start()
    except LaunchError as exc:
        print(f"narwhal demo: {exc}")
        for p in stack.procs:
            print(f"--- {p.name}\n{p.tail()}")
        return 1
    print(f"Narwhal demo ready: Envoy on {stack.url}, admin on {stack.admin_url}")
    for s in sims:
        print(f"  engine {s.name} ({s.dialect}) on http://127.0.0.1:{s.port}")
    print(f"""
Try:
  curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}]}}'
  curl -sN {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hi"}}]}}'
  curl -s {stack.admin_url}/status
Ctrl-C stops every process (logs in {stack.workdir}).""", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        while not stopped.wait(0.5):
            dead = [p.name for p in stack.procs if p.popen.poll() is not None]
            if dead:
                print(f"narwhal demo: {', '.join(dead)} exited; stopping")
                return 1
    finally:
        stack.stop()
    return 0
