"""Which `transformers` causal-LM families run the same under DBO: generate, train, sharded.

    .venv/bin/python benchmarks/hf_families.py                   # every family: ~1 hour
    .venv/bin/python benchmarks/hf_families.py --only mixtral,gemma2 --json
    .venv/bin/python benchmarks/hf_families.py --cache static   # a StaticCache instead
    .venv/bin/python benchmarks/hf_families.py --train   # a training step's gradients
    .venv/bin/python benchmarks/hf_families.py --shard   # the MoE families, sharded: ~30 min
    .venv/bin/python benchmarks/hf_families.py --shard --capacity 48   # the fixed-shape path

For each model type transformers maps to a causal LM, `python -m dbo.hf.check` (the
check shipped with dbo, whose docstring says what it builds and compares) runs one check
in a process of its own: generation with the cache kind of `--cache`, or with `--train`
a training step. The outcomes: equal, WRONG (a silent wrong result, the bug to fix
first), refused, FAILED (another error under dbo only: a bug), no model (the tiny config
does not build or run without dbo: not dbo's case).

`--shard` checks `comm.moe.shard_experts` instead, on the families whose config names
experts: in a world of 2 gloo ranks (torchrun), each with 4 rows of its own, the sharded
model's logits and gradients, plain and under `dbo.overlap`, against the unsharded model's
on all 8 rows (allclose: the experts' sums run in another order; an expert's gradient
against its rows of the unsharded one, a replicated one summed over the ranks).
"refused": shard_experts refused it, naming why; "no experts": the tiny model has no
experts module (its MoE layers start deeper). `--capacity 48` takes the fixed-shape path
with room for every (token, expert) pair a rank has in one call (4 rows of 6 tokens, top-2),
so it drops none, even where a router picks one expert twice for a token (a tiny
DeepSeek-V4's hash layers, whose token-to-expert table starts at zeros).

Each family runs in its own process (or world), with a timeout (some build slowly), on
the installed transformers whether or not dbo is tested on it (the survey is what tests
a release). The exit status is 1 if any family is WRONG or FAILED.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dbo.hf.check import close_to, first_model, gradients, outcome, same_grads  # noqa: E402


def check_sharded(kind: str, capacity: int | None = None) -> dict[str, Any]:
    """One family's outcome with its experts sharded over the ranks of this torchrun world
    (`capacity`: on the fixed-shape path): logits and gradients, plain and overlapped,
    against the unsharded model's on every rank's rows at once."""
    import torch

    import comm
    import dbo

    rank, world_size, _ = comm.init_distributed(timeout_s=60, allow_single_process=True)
    ids = torch.randint(3, 64, (4 * world_size, 6), generator=torch.Generator().manual_seed(7))
    mine = slice(4 * rank, 4 * (rank + 1))

    def whole_batch(model: Any) -> tuple[Any, dict[str, Any], Any]:
        logits = model(ids).logits
        probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(8))
        return logits.detach(), gradients(model, logits, probe, zeros_for_none=True), probe

    try:
        built = first_model(kind, whole_batch)
        if isinstance(built, dict):
            return built
        model, (expected, expected_grads, probe) = built
        if not any(name.endswith("experts") for name, _ in model.named_modules()):
            return {"outcome": "no experts"}
        try:
            blocks = comm.moe.shard_experts(model, capacity=capacity)
        except ValueError as error:
            return outcome("refused", error)
        same = True
        for step in (model, dbo.overlap(model, timeout_s=60)):
            try:
                logits = step(ids[mine]).logits
                grads = gradients(model, logits, probe[mine], zeros_for_none=True)
            except Exception as error:  # noqa: BLE001 - what works unsharded must work sharded
                return outcome("FAILED", error)
            same &= close_to(logits, expected[mine])
            whole = _as_unsharded(grads, blocks, expected_grads, rank)
            same &= same_grads(whole, expected_grads, exact=False)
        everywhere = torch.tensor(int(same))  # rank 0 reports: WRONG on any rank
        torch.distributed.all_reduce(everywhere, torch.distributed.ReduceOp.MIN)
        same = bool(everywhere)
    finally:
        comm.destroy_distributed()
    return {"outcome": "equal" if same else "WRONG"}


def _as_unsharded(
    grads: dict[str, Any], blocks: list[str], expected: dict[str, Any], rank: int
) -> dict[str, Any]:
    """This rank's sharded gradients in the unsharded model's terms: an expert parameter's
    in its experts' rows of the reference's (the reference's elsewhere), a replicated one
    summed over the ranks (each ran rows of its own)."""
    import torch

    whole = {}
    for name, grad in grads.items():
        if any(name.startswith(f"{block}.experts.") for block in blocks):
            whole[name] = expected[name].clone()
            whole[name][rank * len(grad):(rank + 1) * len(grad)] = grad
        else:
            whole[name] = grad.clone()
            torch.distributed.all_reduce(whole[name])
    return whole


def _names_experts(kind: str) -> bool:
    import transformers

    try:
        config = transformers.AutoConfig.for_model(kind)
    except Exception:  # noqa: BLE001 - its default config does not build: no model
        return False
    text = getattr(config, "text_config", None)
    names = set(config.to_dict()) | (set(text.to_dict()) if text is not None else set())
    return any("expert" in name for name in names)


def _command(kind: str, args: argparse.Namespace) -> list[str]:
    """The process (or torchrun world of 2 ranks) that checks one family."""
    if args.shard:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", __file__, "--one", kind, "--shard",
                *(["--capacity", str(args.capacity)] if args.capacity is not None else [])]
    return [sys.executable, "-m", "dbo.hf.check", "--family", kind, "--json",
            "--checks", "train" if args.train else args.cache]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every one)")
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                        help="the KV cache generate makes (default dynamic)")
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--shard", action="store_true",
                        help="check comm.moe.shard_experts on the MoE families instead")
    parser.add_argument("--capacity", type=int,
                        help="with --shard: the fixed-shape path, rows per (rank, expert)")
    parser.add_argument("--train", action="store_true",
                        help="check a training step's gradients instead")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the per-family process
    args = parser.parse_args()
    if args.train and args.shard:
        parser.error("--train and --shard are two surveys: pass one")
    if args.capacity is not None and not args.shard:
        parser.error("--capacity applies to --shard only")
    if args.one:  # one family's sharded world
        result = check_sharded(args.one, args.capacity)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result))
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kinds = args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.shard and not args.only:
        kinds = [kind for kind in kinds if _names_experts(kind)]
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        try:
            done = subprocess.run(
                _command(kind, args), capture_output=True, text=True,
                timeout=args.timeout_s, cwd=ROOT,
                env=dict(os.environ, CUDA_VISIBLE_DEVICES="") if args.shard else None,
            )
            last = (done.stdout.strip().splitlines() or [""])[-1]
            result = json.loads(last) if last.startswith("{") else None
            if result is not None and not args.shard:  # dbo.hf.check's: its one check
                result = next(iter(result["families"][kind].values()))
            results[kind] = result or {
                "outcome": "no model", "why": f"crashed (status {done.returncode})"}
        except subprocess.TimeoutExpired:
            results[kind] = {"outcome": "no model", "why": f"over {args.timeout_s:g} s"}
        print(f"{kind:28s} {results[kind]['outcome']:9s} {results[kind].get('why', '')[:90]}",
              file=sys.stderr, flush=True)
    counts = Counter(result["outcome"] for result in results.values())
    print(", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())))
    if args.json:
        print(json.dumps({"counts": counts, "families": results}))
    sys.exit(1 if counts["WRONG"] or counts["FAILED"] else 0)


if __name__ == "__main__":
    main()
