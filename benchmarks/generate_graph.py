"""A decode step of a Hugging Face MoE model, StaticCache and fixed-shape MoE path, captured
with `dbo.capture_graph` and replayed: the same tokens as eager DBO generation.

    torchrun --standalone --nproc-per-node 1 benchmarks/generate_graph.py --json   # NCCL
    python benchmarks/generate_graph.py --json      # a CPU world of one: the eager loop only

A tiny random-weight Qwen3-MoE (experts as one batched matmul, `shard_experts` with a
capacity: no host read) generates `--new-tokens` tokens for `--rows` left-padded prompts
under `dbo.hf.overlap_generation` with a StaticCache: the reference. Then a decode loop
of its own: the prefill overlapped eagerly, each decode step a replay of one captured
overlapped step (`capture_graph(step, token, mask, cache)`; its warmup and capture runs
advance the cache, `cache.crop` takes them back). Without CUDA the decode steps run as
eager DBO instead (a smoke test of the script). Prints the token check and the time per
decode step, eager DBO against the replay; exit status 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from generate import prompts  # noqa: E402 - the generation example's prompts
from hf_moe import build_model  # noqa: E402

import comm  # noqa: E402
import dbo  # noqa: E402

WARMUP = 2


def decode_loop(
    step: Callable[..., torch.Tensor], decode: Callable[..., torch.Tensor], ids: torch.Tensor,
    mask: torch.Tensor, cache: Any, new_tokens: int,
) -> tuple[torch.Tensor, float]:
    """Greedy tokens: `step` on the prompts, then `decode(token, mask, cache)` per token;
    and the mean time of a decode step in ms."""
    with torch.no_grad():
        token = step(ids, mask[:, : ids.shape[1]], cache)[:, -1:].argmax(-1)
        out = [ids, token]
        _synchronize(ids.device)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = decode(token, mask, cache)[:, -1:].argmax(-1)
            out.append(token)
        _synchronize(ids.device)
    return torch.cat(out, dim=1), (time.perf_counter() - start) * 1e3 / (new_tokens - 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="prompts (default 8)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens to generate (8)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    import transformers

    _, world_size, device = comm.init_distributed(allow_single_process=True)
    model = build_model("qwen3_moe", 2, 64, 4, 2, 128).to(device)
    model.set_experts_implementation("batched_mm")  # no host read of the experts hit
    model.generation_config.use_cache, model.generation_config.pad_token_id = True, 0
    comm.moe.shard_experts(model, capacity=args.rows * args.prompt_len)  # drops none
    ids, mask = prompts(args.rows, args.prompt_len, 128, 0, device)
    with torch.no_grad(), dbo.hf.overlap_generation(model, min_prefill_tokens=0,
                                                   min_decode_tokens=0, timeout_s=60):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  do_sample=False, cache_implementation="static")

    def step(tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(tokens, attention_mask=attention_mask, cache=cache, use_cache=True).logits

    eager = dbo.overlap(step, timeout_s=60)
    room = args.prompt_len + args.new_tokens + WARMUP + 1  # the capture's runs write too
    full_mask = torch.cat([mask, mask.new_ones(args.rows, room - args.prompt_len)], dim=1)

    def new_cache() -> Any:
        return transformers.StaticCache(config=model.config, max_cache_len=room)

    eager_tokens, eager_ms = decode_loop(eager, eager, ids, full_mask, new_cache(),
                                         args.new_tokens)
    captured = device.type == "cuda"
    replay: Callable[..., torch.Tensor] = eager
    cache = new_cache()
    if captured:
        with torch.no_grad():
            eager(ids, full_mask[:, : args.prompt_len], cache)  # fills the cache's layout
            cache.reset()
            token = ids[:, -1:]
            graph = dbo.capture_graph(step, token, full_mask, cache, warmup=WARMUP)
            cache.reset()
        replay = graph
    graph_tokens, graph_ms = decode_loop(eager, replay, ids, full_mask, cache, args.new_tokens)
    result = {
        "device": device.type, "world_size": world_size, "rows": args.rows,
        "new_tokens": args.new_tokens, "captured": captured,
        "tokens_equal": bool(torch.equal(graph_tokens, expected)),
        "eager_loop_equal": bool(torch.equal(eager_tokens, expected)),
        "eager_ms_per_step": eager_ms, "graph_ms_per_step": graph_ms,
        "graph_speedup": eager_ms / graph_ms,
    }
    print(f"decode steps captured in a CUDA graph: {captured}; tokens equal to eager DBO "
          f"generation: {result['tokens_equal']} (eager loop: {result['eager_loop_equal']})")
    print(f"ms per decode step: eager DBO {eager_ms:.2f}, "
          f"{'replay' if captured else 'eager again'} {graph_ms:.2f}")
    if args.json:
        print(json.dumps(result))
    comm.destroy_distributed()
    return 0 if result["tokens_equal"] and result["eager_loop_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
