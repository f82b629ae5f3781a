"""Which `transformers` causal-LM families run the same under DBO: generate, train, sharded.

    .venv/bin/python benchmarks/hf_families.py                   # every family: ~1 hour
    .venv/bin/python benchmarks/hf_families.py --only mixtral,gemma2 --json
    .venv/bin/python benchmarks/hf_families.py --cache static   # a StaticCache instead
    .venv/bin/python benchmarks/hf_families.py --train   # a training step's gradients
    .venv/bin/python benchmarks/hf_families.py --shard   # the MoE families, sharded: ~30 min
    .venv/bin/python benchmarks/hf_families.py --shard --capacity 48   # the fixed-shape path

For each model type transformers maps to a causal LM, a tiny random-weight model is built
from its config (2 layers, or 8 if it needs them, hidden 32, 4 experts top-2 where it has
experts; the hybrids in FAMILIES get layer lists with an attention layer) and `generate`
runs greedy (a DynamicCache, or a StaticCache with `--cache static`), 5 new tokens for 4
left-padded prompts, with and without `dbo.hf.overlap_generation` (every call split); and
`dbo.overlap(model)` runs one forward, no cache passed in, against the two halves in turn.
A family's outcome:

  equal        the same tokens, and the overlapped forward bitwise the halves'
  WRONG        different tokens or logits: a silent wrong result, the bug to fix first
  refused      dbo refused it, naming what it cannot split (a kind of cache layer, ...)
  FAILED       another error under dbo only: a bug
  no model     the tiny config does not build or generate without dbo: not dbo's case

`--train` checks a training step instead: the gradient of every parameter (None where the
loss reaches none) of a weighted sum of the logits, through `dbo.overlap(model)` against
the two halves in turn: "equal" is bit for bit, or allclose where the model ties weights
(a tied weight's two uses add up in another order, as the README says).

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

Each family runs in its own process (or world), with a timeout (some build slowly). The
exit status is 1 if any family is WRONG or FAILED.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMALL: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=0, max_position_embeddings=256, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, sliding_window=4,
)
"""Set on a family's config (and its text_config) where it has the attribute; a window of
4 tokens, which the 6-token prompts overflow."""


ATTEMPTS = [dict(num_key_value_heads=2), dict(num_key_value_heads=4),
            dict(num_key_value_heads=2, num_hidden_layers=8)]
"""Overrides tried in turn until the model generates without dbo: latent attention (MLA)
wants as many kv heads as heads; hybrids need enough layers for an attention layer."""


_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8)
FAMILIES: dict[str, dict[str, Any]] = {
    "bamba": dict(attn_layer_indices=[1], **_MAMBA),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], **_MAMBA),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"], linear_head_dim=8,
                        linear_num_heads=4, qk_head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8, head_dim=8, n_groups=1, state_size=16, chunk_size=8),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2,
                  attention_head_dim=16, attention_hidden_size=64, mamba_dt_rank=4,
                  n_mamba_heads=2, mamba_d_state=8),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   attention_head_dim=16, attention_hidden_size=64, mamba_headdim=8,
                   n_mamba_heads=8, mamba_d_state=16, chunk_size=8),
}
"""Hybrids whose layer-type lists and mamba shapes do not follow from SMALL: each gets an
attention layer among its 2 (Zamba: 4) layers and mamba heads that fit hidden 32."""


def build(kind: str, overrides: dict[str, int]) -> Any:
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = transformers.AutoConfig.for_model(kind)
    for target in (config, getattr(config, "text_config", None)):
        for name, value in {**SMALL, **overrides, **FAMILIES.get(kind, {})}.items():
            if target is not None and hasattr(target, name):
                setattr(target, name, value)
    torch.manual_seed(0)
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])(config).eval()


def _outcome(outcome: str, error: Exception) -> dict[str, str]:
    """An outcome with why: a refusal's message, or another error's type and message."""
    why = str(error) if outcome == "refused" else f"{type(error).__name__}: {error}"
    return {"outcome": outcome, "why": why[:200]}


def first_model(kind: str, reference: Callable[[Any], Any]) -> tuple[Any, Any] | dict[str, str]:
    """(model, reference(model)) for the first of ATTEMPTS that builds and runs; else the
    "no model" outcome."""
    for overrides in ATTEMPTS:
        try:
            model = build(kind, overrides)
            return model, reference(model)
        except Exception as error:  # noqa: BLE001 - the tiny config is not a model
            failure = _outcome("no model", error)
    return failure


def _prompts() -> tuple[Any, Any]:
    """4 prompts of 6 tokens, two of them left-padded, and their attention mask."""
    import torch

    ids = torch.randint(3, 64, (4, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[3, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def _gradients(
    model: Any, logits: Any, probe: Any = None, zeros_for_none: bool = False
) -> dict[str, Any]:
    """Every parameter's gradient (None where the loss reaches none) of `(logits * probe).sum()`
    (`probe`: fixed random weights by default); the model's gradients are cleared after."""
    import torch

    if probe is None:
        probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(8))
    (logits.float() * probe).sum().backward()
    grads = {name: torch.zeros_like(param) if param.grad is None and zeros_for_none
             else param.grad for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _close(got: Any, want: Any) -> bool:
    """Equal to within 1e-4 of `want`'s largest magnitude: sums over the rows run in
    another order (a gradient of magnitude 100 may differ by 1e-4 where it is near 0)."""
    import torch

    scale = float(want.abs().max()) if want.numel() else 0.0
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale + 1e-6)


def _same(got: dict[str, Any], want: dict[str, Any], exact: bool) -> bool:
    import torch

    def one(a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        return torch.equal(a, b) if exact else _close(a, b)

    return got.keys() == want.keys() and all(one(got[name], want[name]) for name in got)


def check(kind: str, cache: str) -> dict[str, Any]:
    """One family's outcome with `generate`'s `cache_implementation=cache` (in a process
    of its own)."""
    import torch

    import dbo

    ids, mask = _prompts()
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=True,
                   cache_implementation=cache)
    built = first_model(kind, lambda model: model.generate(ids, attention_mask=mask, **options))
    if isinstance(built, dict):
        return built
    model, expected = built
    try:
        with dbo.hf.overlap_generation(model, min_prefill_tokens=0, min_decode_tokens=0,
                                       timeout_s=60):
            got = model.generate(ids, attention_mask=mask, **options)
        with torch.no_grad():
            logits = dbo.overlap(model, timeout_s=60)(ids, attention_mask=mask).logits
            halves = [model(i, attention_mask=m).logits
                      for i, m in zip(ids.tensor_split(2), mask.tensor_split(2))]
    except ValueError as error:
        return _outcome("refused", error)
    except Exception as error:  # noqa: BLE001 - what works without dbo must work with it
        return _outcome("FAILED", error)
    same = torch.equal(got, expected) and torch.equal(logits, torch.cat(halves))
    return {"outcome": "equal" if same else "WRONG"}


def check_train(kind: str) -> dict[str, Any]:
    """One family's outcome for a training step: every parameter's gradient through
    `dbo.overlap(model)` against the two halves' in turn."""
    import torch

    import dbo

    ids, mask = _prompts()

    def in_turn(model: Any) -> dict[str, Any]:
        halves = [model(i, attention_mask=m).logits
                  for i, m in zip(ids.tensor_split(2), mask.tensor_split(2))]
        return _gradients(model, torch.cat(halves))

    built = first_model(kind, in_turn)
    if isinstance(built, dict):
        return built
    model, expected = built
    try:
        got = _gradients(model, dbo.overlap(model, timeout_s=60)(ids, attention_mask=mask).logits)
    except ValueError as error:
        return _outcome("refused", error)
    except Exception as error:  # noqa: BLE001 - what works without dbo must work with it
        return _outcome("FAILED", error)
    # A tied weight's two uses add up in another order (README: allclose).
    tied = len(list(model.parameters())) < len(list(model.named_parameters(remove_duplicate=False)))
    return {"outcome": "equal" if _same(got, expected, exact=not tied) else "WRONG"}


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
        return logits.detach(), _gradients(model, logits, probe, zeros_for_none=True), probe

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
            return _outcome("refused", error)
        same = True
        for step in (model, dbo.overlap(model, timeout_s=60)):
            try:
                logits = step(ids[mine]).logits
                grads = _gradients(model, logits, probe[mine], zeros_for_none=True)
            except Exception as error:  # noqa: BLE001 - what works unsharded must work sharded
                return _outcome("FAILED", error)
            same &= _close(logits, expected[mine])
            whole = _as_unsharded(grads, blocks, expected_grads, rank)
            same &= _same(whole, expected_grads, exact=False)
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
    return [sys.executable, __file__, "--one", kind, "--cache", args.cache,
            *(["--train"] if args.train else [])]


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
    if args.one:
        result = (check_sharded(args.one, args.capacity) if args.shard else check_train(args.one)
                  if args.train else check(args.one, args.cache))
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
            results[kind] = (json.loads(last) if last.startswith("{") else None) or {
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
    sys.path.insert(0, str(ROOT))
    main()
