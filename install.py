"""Install minisgl into .venv/ on Linux, macOS or Windows; `make install` runs this too.

    python install.py            # torch (the CPU build on Linux), minisgl (editable) and pytest
    python install.py --triton   # also Triton (Linux x86-64): tests/test_qkv_epilogue.py then runs
                                 # the fused q/k/v kernel in Triton's CPU interpreter
    python install.py --cuda     # an NVIDIA GPU: torch's CUDA build and the `cuda` extra (FlashInfer, Triton)

Afterwards, without make (on Windows the interpreter is .venv\\Scripts\\python):

    .venv/bin/python -m minisgl demo
    .venv/bin/python -m pytest -q
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
SUPPORTED_PYTHONS = ((3, 10), (3, 14))  # keep in step with requires-python in pyproject.toml
TORCH = "torch==2.13.0"  # the version the tests run with
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only wheels: no nvidia-* packages
PROBE_TIMEOUT_S = 3.0
# pip warns once per package about an index folder that lacks it (a local mirror in pip's
# configuration): noise that hides the real messages.
PIP_NOISE = re.compile(r"^WARNING: Location '.*' is ignored")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def cpu_index_reachable() -> bool:
    """One short request, no retries: where the index cannot be reached the fallback starts at once."""
    try:
        urllib.request.urlopen(urllib.request.Request(f"{CPU_INDEX}/torch/", method="HEAD"), timeout=PROBE_TIMEOUT_S)
        return True
    except OSError:
        return False


def pip(*args: str) -> None:
    """Run pip in the venv. Its progress bars go to stdout, left on the terminal; its stderr is
    filtered line by line."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.Popen([str(venv_python()), "-m", "pip", "install", *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if not PIP_NOISE.match(line):
            sys.stderr.write(line)
    if proc.wait():
        sys.exit(f"install.py: pip install {' '.join(args)} failed (exit code {proc.returncode})")


def torch_source(cuda: bool) -> list[str]:
    """pip arguments that pick torch's build for this machine."""
    if cuda or platform.system() != "Linux":
        return []  # the default index: the CUDA build on Linux, CPU-only builds on macOS and Windows
    if cpu_index_reachable():
        print(f"torch: the CPU build from {CPU_INDEX}")
        return ["--index-url", CPU_INDEX]
    print(f"torch: {CPU_INDEX} is not reachable, so torch comes from pip's configured index. From the "
          "public PyPI that is the CUDA build (several GB); a mirror may hold the CPU build.")
    return []


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="torch's CUDA build and the cuda extra")
    parser.add_argument("--triton", action="store_true", help="also Triton, for its CPU interpreter test")
    args = parser.parse_args()
    (low, high), here = SUPPORTED_PYTHONS, sys.version_info[:2]
    if not low <= here <= high:
        sys.exit(f"install.py: Python {here[0]}.{here[1]} is not supported: {TORCH} has wheels for, and the "
                 f"tests run on, Python {low[0]}.{low[1]} to {high[0]}.{high[1]}")
    start = time.perf_counter()
    if not venv_python().exists():
        print(f"creating {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    # torch first, alone: the package's own install then finds it satisfied and cannot pull
    # another build from the default index.
    pip(TORCH, *torch_source(args.cuda))
    extras = ["dev"] + (["cuda"] if args.cuda else [])
    pip("-e", f"{ROOT}[{','.join(extras)}]")
    if args.triton and not args.cuda:
        pip("triton>=3.0")
    (VENV / ".installed").touch()  # the Makefile's stamp: make does not install again
    seconds = time.perf_counter() - start
    print(f"installed in {seconds:.0f} s; {VENV} holds {folder_bytes(VENV) / 2**30:.2f} GiB")
    run = venv_python().relative_to(ROOT)
    print(f"next: {run} -m minisgl demo   |   {run} -m pytest -q")


if __name__ == "__main__":
    main()
