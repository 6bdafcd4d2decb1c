"""Benchmarks: the data path (``bench.datapath``), one message in process
(``bench.messages``), matching a long prompt's KV blocks (``bench.kv_match``),
scheduling on the simulator (``bench.scheduling``), and in front of real vLLM:
admission (``bench.vllm_admission``), drift (``bench.vllm_drift``) and prefix-aware
placement over a pool of two (``bench.vllm_prefix``)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from narwhal.launch import free_port, wait_http


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """One temporary directory for a run, holding every stack's logs and Unix sockets
    (``tempfile.tempdir`` points into it meanwhile): removed when the run ends, kept with
    its path printed when it fails (the logs are what one reads then)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    saved = tempfile.tempdir
    tempfile.tempdir = str(root)
    try:
        yield root
    except BaseException:
        print(f"bench: logs kept in {root}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(root, ignore_errors=True)
    finally:
        tempfile.tempdir = saved


def vllm_router_exe() -> str:
    """The peer router's executable (``vllm-router`` from PyPI, the ``bench`` extra):
    this venv's, else one on PATH. Missing, the run stops at once with how to install it,
    not after the cells that ran before the first one needing it (their results were
    lost with the traceback)."""
    own = Path(sys.executable).with_name("vllm-router")
    exe = str(own) if own.exists() else shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("bench: vllm-router is not installed: pip install -e '.[bench]' "
                         "(make bench and make bench-scheduling do)")
    return exe


def vllm_router(engines: list[str], policy: str, workdir: Path) -> tuple[subprocess.Popen, int]:
    """The peer router with ``policy`` in front of the engines at the URLs ``engines``."""
    port = free_port()
    log = open(workdir / f"vllm-router-{policy}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([vllm_router_exe(), "--host", "127.0.0.1", "--port", str(port),
                             "--policy", policy, "--worker-urls", *engines,
                             "--prometheus-port", str(free_port()), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health", 60, proc)
    return proc, port


def names(parser: argparse.ArgumentParser, value: str, allowed: Iterable[str],
          what: str) -> list[str]:
    """The comma-separated names in ``value``, each one of ``allowed``: an unknown one is
    the parser's error (naming them all) before anything starts."""
    known = tuple(allowed)
    out = [n for n in value.split(",") if n]
    for n in out:
        if n not in known:
            parser.error(f"unknown {what} {n!r}; one of {', '.join(known)}")
    return out


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """The real-vLLM benchmarks' common options: the workload's seed, and where to keep
    each cell's per-request samples and Narwhal's /status trace."""
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", default="", help="a folder for per-request samples "
                        "and Narwhal's /status trace (JSON lines)")
