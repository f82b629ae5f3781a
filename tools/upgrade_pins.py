"""Move constraints.txt to the newest releases, only once every check passes on them.

    make upgrade-pins                               # torch stays at its pin
    make upgrade-pins TORCH_SPEC=torch==2.14.1      # torch moves too

1. In a venv of its own (.venv-upgrade, made anew): torch (the pin, or `--torch`), dbo
   with its test extras, then the newest release of every other package constraints.txt
   pins, past dbo's declared ranges (that is what is being tested).
2. The checks, with DBO_ALLOW_UNTESTED_VERSIONS=1 (the new releases are not tested yet):
   ruff, mypy, pytest, and the transformers families survey (benchmarks/hf_families.py)
   in its four modes: generation with a DynamicCache and with a StaticCache, a training
   step, and sharded. A survey passes with no family WRONG or FAILED. About three hours
   on a 2-core machine.
3. Only if all pass: constraints.txt becomes that venv's versions, and the tested ranges
   (pyproject.toml, and dbo/hf/versions.py for transformers) widen to take the new
   releases. Otherwise nothing is written and the check that failed is named. The
   survey's counts are printed for the upgrade's commit message.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
VENV = ROOT / ".venv-upgrade"
SURVEYS = (["--cache", "dynamic"], ["--cache", "static"], ["--train"], ["--shard"])


def run(*command: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, command)), flush=True)
    return subprocess.run([str(part) for part in command], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.MULTILINE))


def minor(version: str) -> tuple[int, int]:
    major, minor_ = version.split("+")[0].split(".")[:2]
    return int(major), int(minor_)


def widen(text: str, package: str, version: str) -> str:
    """`text` with every `package>=LOW,<HIGH` raised to take `version`'s minor."""
    major, minor_ = minor(version)

    def raised(found: re.Match[str]) -> str:
        high = max(minor(found[2]), (major, minor_ + 1))
        return f"{package}>={found[1]},<{high[0]}.{high[1]}"

    return re.sub(rf"{package}>=([\d.]+),<([\d.]+)", raised, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="the torch to test (default: constraints.txt's pin)")
    args = parser.parse_args()
    old = pins(CONSTRAINTS.read_text())
    torch_spec = args.torch or f"torch=={old['torch']}"
    shutil.rmtree(VENV, ignore_errors=True)
    python = VENV / "bin" / "python"
    env = {**os.environ, "DBO_ALLOW_UNTESTED_VERSIONS": "1"}
    steps = [
        ("venv", [sys.executable, "-m", "venv", VENV]),
        ("torch", [python, "-m", "pip", "install", "-q", torch_spec]),
        ("dbo", [python, "-m", "pip", "install", "-q", "-e", ".[test]"]),
        ("newest", [python, "-m", "pip", "install", "-q", "-U",
                    *[name for name in old if name != "torch"]]),
        ("ruff", [VENV / "bin" / "ruff", "check", "dbo", "workspace", "comm", "examples",
                  "tests", "benchmarks", "tools"]),
        ("mypy", [VENV / "bin" / "mypy", "dbo", "workspace", "comm"]),
        ("pytest", [python, "-m", "pytest", "-q"]),
        *((f"survey {' '.join(survey)}", [python, "benchmarks/hf_families.py", *survey])
          for survey in SURVEYS),
    ]
    counts = []
    for name, command in steps:
        done = run(*command, env=env)
        if name.startswith("survey"):
            counts.append(f"{name}: {(done.stdout.strip().splitlines() or ['?'])[-1]}")
        if done.returncode != 0:
            print(done.stdout[-5000:])
            print(f"upgrade-pins: {name} failed; constraints.txt and the ranges are unchanged")
            return 1
    freeze = run(python, "-m", "pip", "freeze", "--exclude-editable").stdout
    new = {name: version.split("+")[0] for name, version in pins(freeze).items()}
    header = "".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines()
                     if line.startswith("#"))
    CONSTRAINTS.write_text(header + "".join(f"{name}=={version}\n"
                                            for name, version in sorted(new.items())))
    pyproject = ROOT / "pyproject.toml"
    text = widen(pyproject.read_text(), "transformers", new["transformers"])
    pyproject.write_text(widen(text, "torch", new["torch"]))
    versions = ROOT / "dbo" / "hf" / "versions.py"
    high = "{}.{}".format(*minor(new["transformers"]))
    versions.write_text(re.sub(r'TESTED_TRANSFORMERS = \("([\d.]+)", "([\d.]+)"\)',
                               lambda found: f'TESTED_TRANSFORMERS = ("{found[1]}", '
                               f'"{max(found[2], high, key=minor)}")', versions.read_text()))
    changed = {name: (old.get(name), version) for name, version in new.items()
               if old.get(name) != version}
    for name, (before, after) in sorted(changed.items()):
        print(f"{name}: {before} -> {after}")
    print("\n".join(counts))
    print("upgrade-pins: every check passed; constraints.txt and the ranges rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
