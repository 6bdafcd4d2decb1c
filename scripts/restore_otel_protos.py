"""Put opentelemetry-proto's own files back after xds-protos overwrote them.

Both distributions ship ``opentelemetry/proto/...``: xds-protos carries an old copy (for
Envoy's OpenTelemetry configs) that lacks what the OTLP exporter imports
(``InstrumentationScope``), and whichever pip installs last wins. Reinstalling the
installed opentelemetry-proto (same version, no dependencies) restores its files; the
newer protos are a superset of what xds-protos's modules use. Run after every install.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys


def intact() -> bool:
    code = "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def main() -> int:
    try:
        version = importlib.metadata.version("opentelemetry-proto")
    except importlib.metadata.PackageNotFoundError:
        return 0  # tracing's dependencies are not installed: nothing to restore
    if intact():
        return 0
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall",
                    "--no-deps", f"opentelemetry-proto=={version}"], check=True)
    if not intact():
        print("opentelemetry-proto is still shadowed by another distribution", file=sys.stderr)
        return 1
    print(f"restored opentelemetry-proto {version}'s files (xds-protos had overwritten them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
