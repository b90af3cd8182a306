"""The tests' wheels for `environment:` (orchestrator/environment/): one folder of wheels that the
tests' specs resolve from alone (`find_links` + `no_index`), and tiny wheels a test makes itself.

The folder (~/.cache/orchestrate-tests/wheelhouse, or $ORCHESTRATE_TEST_WHEELHOUSE) holds
tensorflow-cpu at the version this checkout's own TensorFlow has, with every wheel it needs,
psutil, py-spy and uv: ~340 MB, downloaded once per machine from the package index by
`python -m tests.wheelhouse` — the one step of the suite that asks an index, which `.ci/run` takes
before the tests. The tests that need the folder are marked `wheelhouse` (`-m "not wheelhouse"`
leaves them out); one that finds it missing fills it the same way.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from orchestrator.environment.request import UV

TIMEOUT_S = 900.0


def folder() -> Path:
    given = os.environ.get("ORCHESTRATE_TEST_WHEELHOUSE")
    return Path(given) if given else Path.home() / ".cache" / "orchestrate-tests" / "wheelhouse"


def requirements() -> list[str]:
    tf = importlib.metadata.version("tensorflow")
    return [f"tensorflow-cpu=={tf}", f"psutil=={importlib.metadata.version('psutil')}", "py-spy", UV]


def ensure() -> Path:
    """The folder, with every wheel the tests' environments need (downloaded once)."""
    target = folder()
    stamp = target / ("." + hashlib.sha256("\n".join(requirements()).encode()).hexdigest()[:16])
    if stamp.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(target)]
    subprocess.run([*argv, *requirements()], check=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    stamp.touch()
    return target


def tiny_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of one module `name` (its VALUE = `version`; Requires-Dist: `requires`):
    what a changed requirement adds, made here without any index."""
    dist = f"{name}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}.py": f"VALUE = {version!r}\n".encode(),
        f"{dist}.dist-info/METADATA": metadata.encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_in, data in files.items():
            z.writestr(zipfile.ZipInfo(name_in, (2026, 1, 1, 0, 0, 0)), data)  # the same bytes each time
    return path


if __name__ == "__main__":
    print(ensure())
