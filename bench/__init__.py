"""Benchmarks: the data path (``bench.datapath``), one message in process
(``bench.messages``), matching a long prompt's KV blocks (``bench.kv_match``),
scheduling on the simulator (``bench.scheduling``) and admission in front of real vLLM
(``bench.vllm_admission``)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
