"""The wheels `benchmarks/gpu_check.sh` installs on the GPU machine, downloaded here.

    python benchmarks/gpu_wheels.py [OUTDIR]      # default bench-out/gpu-wheels

The GPU machine cannot reach a package index, and its image holds a `transformers` older
than dbo's tested releases (`dbo.hf.versions`). This downloads, for its Python (3.12,
x86-64 Linux), the pinned (`constraints.txt`) `transformers` and the packages it needs
at versions newer than the image's: `CARRIED`. Carry OUTDIR with the checkout; the check
installs them into a folder of its own (`pip install --no-deps --target`), put first on
the steps' `PYTHONPATH`. Without them, the steps that need a tested `transformers` are
reported as skipped, with why.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench-out" / "gpu-wheels"
GPU_PYTHON = "3.12"
CARRIED = ("transformers", "huggingface_hub", "kernels", "tomlkit", "httpx2", "httpcore2",
           "truststore", "anyio", "idna", "h11", "click", "regex", "hf-xet")
"""`transformers` and what it needs newer than the GPU image has (its hub 1.33 predates
the hub 2.x that transformers 5.25 requires); what the image has recent enough (numpy,
tokenizers, safetensors, pyyaml, tqdm, ...) is the image's own."""


def pins(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """`name==version` of each line of `constraints`, by normalized name."""
    found = {}
    for line in constraints.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if match:
            found[normalized(match[1])] = match[2]
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pinned: dict[str, str]) -> list[str]:
    """`CARRIED` at their pinned versions; a name the pins lack is an error."""
    missing = [name for name in CARRIED if normalized(name) not in pinned]
    if missing:
        raise SystemExit(f"gpu_wheels: constraints.txt pins no {', '.join(missing)}")
    return [f"{name}=={pinned[normalized(name)]}" for name in CARRIED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help="the wheels' folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # only the pinned ones: the check installs every wheel here
        old.unlink()
    platforms = [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                 "manylinux2014_x86_64") for arg in ("--platform", tag)]
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
               "--no-deps", "--only-binary=:all:", "--python-version", GPU_PYTHON,
               "--implementation", "cp", *platforms, "--dest", str(out),
               *requirements(pins())]
    subprocess.run(command, check=True)
    wheels = sorted(path.name for path in out.glob("*.whl"))
    print(f"{len(wheels)} wheels in {out}: {' '.join(wheels)}")
    return 0 if len(wheels) == len(CARRIED) else 1


if __name__ == "__main__":
    sys.exit(main())
