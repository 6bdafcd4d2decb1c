"""The seed suite (request errors, streaming and assembly, token identity) against the
container images, plus what only images can get wrong."""

from __future__ import annotations

import subprocess

from ..test_request_errors import *  # noqa: F403 - the same tests, container fixtures
from ..test_responses import *  # noqa: F403


def test_images_run_as_non_root(images):
    for image in images:
        out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Config.User}}", image],
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() not in ("", "root", "0", "0:0")
