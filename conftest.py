"""One temporary root for the whole test session.

Stacks keep their processes' logs in a directory of their own, Unix sockets live in
short-lived directories, and vLLM's engine puts its ZMQ sockets under ``$TMPDIR``: run
after run they would pile up in ``/tmp``. Everything a session creates goes under one
root instead (child processes inherit ``TMPDIR``), removed when the session passes and
kept, with its path printed, when it fails (the logs are what one reads then).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_ROOT_KEY = pytest.StashKey[tuple[Path, str | None, str | None]]()
_FAILED_KEY = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    root = Path(tempfile.mkdtemp(prefix="narwhal-test-"))
    config.stash[_ROOT_KEY] = (root, tempfile.tempdir, os.environ.get("TMPDIR"))
    tempfile.tempdir = str(root)
    os.environ["TMPDIR"] = str(root)


def pytest_unconfigure(config: pytest.Config) -> None:
    saved = config.stash.get(_ROOT_KEY, None)
    if saved is None:
        return
    root, tempdir, env = saved
    tempfile.tempdir = tempdir
    if env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = env
    if config.stash.get(_FAILED_KEY, True):
        print(f"\nlogs of this session's processes kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_FAILED_KEY] = exitstatus not in (0, 5)  # 5: nothing collected
