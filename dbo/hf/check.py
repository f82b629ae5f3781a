"""Check one `transformers` model family under DBO on the installed releases:

    python -m dbo.hf.check --family falcon_h1              # both cache kinds, and training
    python -m dbo.hf.check --family mixtral,qwen3_moe --checks dynamic,train --json

A tiny random-weight model of each family is built from its config (2 layers, or 8 if it
needs them, hidden 32, 4 experts top-2 where it has experts; the hybrids in FAMILIES get
layer lists with an attention layer). `dynamic` and `static`: `generate` runs greedy with
that cache kind, 5 new tokens for 4 left-padded prompts, with and without
`dbo.hf.overlap_generation` (every call split), and `dbo.overlap(model)` runs one forward,
no cache passed in, against the two halves in turn. `train`: the gradient of every
parameter (None where the loss reaches none) of a weighted sum of the logits, through
`dbo.overlap(model)` against the two halves in turn. A check's outcome:

  equal        the same tokens and logits (bitwise), the same gradients (bitwise, or
               allclose where the model ties weights: a tied weight's two uses add up
               in another order)
  WRONG        different tokens, logits or gradients: a silent wrong result
  refused      dbo refused it, naming what it cannot split (a kind of cache layer, ...)
  FAILED       another error under dbo only: a bug
  no model     the tiny config does not build or run without dbo: not dbo's case

Run it before relying on `DBO_ALLOW_UNTESTED_VERSIONS=1` (which it sets for itself: the
point is to check an untested release). The exit status is 1 if any check is WRONG or
FAILED. `benchmarks/hf_families.py` runs it on every family, one process each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

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


def outcome(name: str, error: Exception) -> dict[str, str]:
    """The outcome `name` with why: a refusal's message, or another error's type and
    message."""
    why = str(error) if name == "refused" else f"{type(error).__name__}: {error}"
    return {"outcome": name, "why": why[:200]}


def first_model(kind: str, reference: Callable[[Any], Any]) -> tuple[Any, Any] | dict[str, str]:
    """(model, reference(model)) for the first of ATTEMPTS that builds and runs; else the
    "no model" outcome."""
    for overrides in ATTEMPTS:
        try:
            model = build(kind, overrides)
            return model, reference(model)
        except Exception as error:  # noqa: BLE001 - the tiny config is not a model
            failure = outcome("no model", error)
    return failure


def prompts() -> tuple[Any, Any]:
    """4 prompts of 6 tokens, two of them left-padded, and their attention mask."""
    import torch

    ids = torch.randint(3, 64, (4, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[3, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def gradients(
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


def close_to(got: Any, want: Any) -> bool:
    """Equal to within 1e-4 of `want`'s largest magnitude: sums over the rows run in
    another order (a gradient of magnitude 100 may differ by 1e-4 where it is near 0)."""
    import torch

    scale = float(want.abs().max()) if want.numel() else 0.0
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale + 1e-6)


def same_grads(got: dict[str, Any], want: dict[str, Any], exact: bool) -> bool:
    import torch

    def one(a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        return torch.equal(a, b) if exact else close_to(a, b)

    return got.keys() == want.keys() and all(one(got[name], want[name]) for name in got)


def check_generation(kind: str, cache: str) -> dict[str, Any]:
    """One family's outcome with `generate`'s `cache_implementation=cache` (in a process
    of its own)."""
    import torch

    import dbo

    ids, mask = prompts()
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
        return outcome("refused", error)
    except Exception as error:  # noqa: BLE001 - what works without dbo must work with it
        return outcome("FAILED", error)
    same = torch.equal(got, expected) and torch.equal(logits, torch.cat(halves))
    return {"outcome": "equal" if same else "WRONG"}


def check_train(kind: str) -> dict[str, Any]:
    """One family's outcome for a training step: every parameter's gradient through
    `dbo.overlap(model)` against the two halves' in turn."""
    import torch

    import dbo

    ids, mask = prompts()

    def in_turn(model: Any) -> dict[str, Any]:
        halves = [model(i, attention_mask=m).logits
                  for i, m in zip(ids.tensor_split(2), mask.tensor_split(2))]
        return gradients(model, torch.cat(halves))

    built = first_model(kind, in_turn)
    if isinstance(built, dict):
        return built
    model, expected = built
    try:
        got = gradients(model, dbo.overlap(model, timeout_s=60)(ids, attention_mask=mask).logits)
    except ValueError as error:
        return outcome("refused", error)
    except Exception as error:  # noqa: BLE001 - what works without dbo must work with it
        return outcome("FAILED", error)
    # A tied weight's two uses add up in another order (README: allclose).
    tied = len(list(model.parameters())) < len(list(model.named_parameters(remove_duplicate=False)))
    return {"outcome": "equal" if same_grads(got, expected, exact=not tied) else "WRONG"}


CHECKS: dict[str, Callable[[str], dict[str, Any]]] = {
    "dynamic": lambda kind: check_generation(kind, "dynamic"),
    "static": lambda kind: check_generation(kind, "static"),
    "train": lambda kind: check_train(kind),
}
"""Each check by name: generation with a DynamicCache, with a StaticCache; a training step."""


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m dbo.hf.check", description=__doc__.splitlines()[0].rstrip(":"))
    parser.add_argument("--family", required=True,
                        help="comma-separated transformers model types (config.model_type)")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated, of {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    if unknown := [name for name in checks if name not in CHECKS]:
        parser.error(f"unknown check {', '.join(unknown)}: pass some of {', '.join(CHECKS)}")
    import transformers

    from dbo.hf.versions import ALLOW_UNTESTED, is_tested

    if not is_tested(transformers.__version__):
        print(f"transformers {transformers.__version__} is not a release dbo is tested on: "
              "checking it", file=sys.stderr)
    os.environ[ALLOW_UNTESTED] = "1"  # this process checks the release, whichever it is
    results: dict[str, dict[str, Any]] = {}
    for kind in args.family.split(","):
        for name in checks:
            result = results.setdefault(kind, {})[name] = CHECKS[name](kind)
            print(f"{kind:24s} {name:8s} {result['outcome']:9s} {result.get('why', '')[:90]}",
                  file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"transformers": transformers.__version__, "families": results}))
    outcomes = [result["outcome"] for family in results.values() for result in family.values()]
    return 1 if "WRONG" in outcomes or "FAILED" in outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
