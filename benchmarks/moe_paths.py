"""The fixed-shape MoE path against the dynamic one at decode-sized batches.

    .venv/bin/python benchmarks/moe_paths.py                  # 16, 64 and 128 tokens per rank
    .venv/bin/python benchmarks/moe_paths.py --tokens 64 --json

Runs `examples/moe_overlap.py --spawn 2` (4 MoE layers, gloo on CPU) per batch size,
once on the dynamic path (`comm.moe.dispatch`) and once on the fixed-shape path
(`--fixed-capacity` = the tokens: nothing dropped), and prints per size the median step
time of the whole batch and of DBO on each path, and the host reads of one whole-batch
inference step (counted by `examples/_host_reads.py`: on a GPU each is a wait for the
device; a DBO step makes them per ubatch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_example(tokens: int, fixed: bool, steps: int, timeout_s: float) -> dict[str, Any]:
    argv = [sys.executable, "examples/moe_overlap.py", "--spawn", "2", "--tokens", str(tokens),
            "--steps", str(steps), "--json", "--out", str(ROOT / "bench-out" / "moe_paths")]
    if fixed:
        argv += ["--fixed-capacity", str(tokens)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64,128", help="tokens per rank, comma-separated")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode (default 15)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per example run")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    rows = []
    print(f"{'tokens':>6} {'path':<8} {'whole ms':>9} {'DBO ms':>8} {'host reads/step':>16}")
    for tokens in (int(value) for value in args.tokens.split(",")):
        for fixed in (False, True):
            result = run_example(tokens, fixed, args.steps, args.timeout_s)
            row = {"tokens": tokens, "path": "fixed" if fixed else "dynamic",
                   "whole_ms": result["serial_ms"], "dbo_ms": result["dbo_ms"],
                   "host_reads_per_step": result["host_reads_per_step"]}
            rows.append(row)
            print(f"{tokens:>6} {row['path']:<8} {row['whole_ms']:>9.2f} {row['dbo_ms']:>8.2f} "
                  f"{row['host_reads_per_step']:>16}", flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
