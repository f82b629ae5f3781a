"""Generation with a KV cache under DBO: a Hugging Face MoE model, expert-parallel, in
three modes (the whole batch, the same ubatches in turn, DBO), token for token the same.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/generate.py
    # no torchrun (a fresh machine, `make demo-generate`): spawn 2 gloo ranks on a free port
    python examples/generate.py --spawn 2

A tiny random-weight Qwen3-MoE (`--model`: the families of `hf_moe.py`) is built from its
config on every rank, its experts sharded over the ranks (`comm.moe.shard_experts`), and
`model.generate` runs on each rank's own batch of left-padded prompts. DBO is
`dbo.hf.overlap_generation(model, decision_group=WORLD)`: every forward of `generate`
(the prefill, then one decode step per token) splits its rows into two ubatches, each
on its own rows of the KV cache. Prints the token check, the prefill time and the decode
time per token of each mode (the forward calls' host time per step, slowest rank), tokens
per second and the KV cache bytes written per decode step, and writes a trace and a PNG
timeline of a short DBO generation (a prefill, two decode steps) per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import _harness
import torch
import torch.distributed as dist
from hf_moe import MODELS, build_model

import comm
import dbo

MODES = ("whole", "split", "dbo")
LABELS = {"whole": "whole batch", "split": "same ubatches in turn", "dbo": "DBO"}


class ForwardTimer:
    """Wraps `model.forward` (outermost) and records each call's host time and tokens per row."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.calls: list[tuple[int, float]] = []

    def __enter__(self) -> ForwardTimer:
        inner = self.model.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            output = inner(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.calls.append((int(ids.shape[1]), (time.perf_counter() - start) * 1e3))
            return output

        self._previous = self.model.__dict__.get("forward")
        self.model.forward = timed
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is None:
            del self.model.forward
        else:
            self.model.forward = self._previous


def prompts(rows: int, length: int, vocab: int, seed: int, device: torch.device):
    """`rows` left-padded prompts of different lengths (row r has r % 5 pads), and the mask."""
    ids = torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(rows):
        pads = min(row % 5, length - 1)
        ids[row, :pads], mask[row, :pads] = 0, 0
    return ids.to(device), mask.to(device)


def rank_main(args: argparse.Namespace) -> None:
    """One rank's work: build and shard the model, generate in the three modes, report."""
    rank, world_size, device = comm.init_distributed()  # launched by `_harness.launch`
    model = build_model(args.model, args.layers, args.hidden, args.experts, args.topk, args.vocab)
    model.generation_config.use_cache, model.generation_config.pad_token_id = True, 0
    comm.moe.shard_experts(model.to(device), capacity=args.capacity)
    dbo.yield_between(model.model.layers)
    ids, mask = prompts(args.batch, args.prompt_len, args.vocab, 1234 + rank, device)
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, synced_gpus=True,
                   cache_implementation=args.cache)
    overlap_options = dict(min_prefill_tokens=args.min_prefill_tokens,
                           min_decode_tokens=args.min_decode_tokens,
                           decision_group=dist.group.WORLD, timeout_s=args.timeout_s)

    def generate(rows: slice, timer: ForwardTimer, **more: Any) -> torch.Tensor:
        with torch.no_grad(), timer:
            return model.generate(ids[rows], attention_mask=mask[rows], **{**options, **more})

    def overlapped(timer: ForwardTimer, **more: Any) -> torch.Tensor:
        with dbo.hf.overlap_generation(model, **overlap_options):
            return generate(slice(None), timer, **more)

    halves = [slice(0, (args.batch + 1) // 2), slice((args.batch + 1) // 2, args.batch)]
    runs: dict[str, Callable[[ForwardTimer], torch.Tensor]] = {
        "whole": lambda timer: generate(slice(None), timer),
        "split": lambda timer: torch.cat([generate(half, timer) for half in halves]),
        "dbo": overlapped,
    }
    results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):  # interleaved, so every mode sees the same conditions
        for mode in MODES:
            timer = ForwardTimer(model, device)
            dist.barrier()
            start = time.perf_counter()
            tokens[mode] = runs[mode](timer)
            total_ms = (time.perf_counter() - start) * 1e3
            prefill = sum(ms for length, ms in timer.calls if length > 1)
            # Every decode step's forward calls (two per step in turn), per step.
            decode = sum(ms for length, ms in timer.calls if length == 1) / (args.new_tokens - 1)
            results[mode].append((prefill, decode, total_ms))
    copies = None
    if args.cache == "dynamic":
        copies = _cache_copies(model, ids, mask, options, overlap_options)
    with dbo.trace() as timeline:  # the prefill and two decode steps: a readable picture
        overlapped(ForwardTimer(model, device), max_new_tokens=3)
    files = _write_trace(args.out, rank, timeline)
    summary = _summarize(args, results, tokens, device, world_size)
    summary["cache_bytes_per_decode_step"] = copies
    if rank == 0:
        _report(args, summary, files)
    if not summary["tokens_equal"]:
        raise SystemExit("generation under DBO gave other tokens than without it")


def _cache_copies(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, options: dict,
    overlap_options: dict,
) -> dict[str, float]:
    """Bytes the DynamicCache handling writes per decode step: `transformers`' own layers
    (their `torch.cat` writes the whole layer, or window, anew each call, counted by
    wrapping their `update`) against dbo's split cache (`dbo.hf.cache_bytes_written`)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    steps = options["max_new_tokens"] - 1
    written = [0]
    layers = (DynamicLayer, DynamicSlidingWindowLayer)
    updates = [layer.update for layer in layers]

    def counting(update: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, keys: torch.Tensor, values: torch.Tensor, *rest: Any, **kw: Any):
            out_keys, out_values = update(self, keys, values, *rest, **kw)
            if keys.shape[-2] == 1:  # a decode step
                written[0] += out_keys.nbytes + out_values.nbytes
            return out_keys, out_values

        return counted

    for layer, update in zip(layers, updates):  # measuring only: restored below
        layer.update = counting(update)
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, **options)
    finally:
        for layer, update in zip(layers, updates):
            layer.update = update
    dbo_bytes = []
    for new_tokens in (1, options["max_new_tokens"]):  # the prefill alone, then all steps
        with torch.no_grad(), dbo.hf.overlap_generation(model, **overlap_options):
            out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True,
                                 **dict(options, max_new_tokens=new_tokens))
        dbo_bytes.append(dbo.hf.cache_bytes_written(out.cache))
    return {"transformers": written[0] / steps, "dbo": (dbo_bytes[1] - dbo_bytes[0]) / steps}


def _write_trace(out: str, rank: int, timeline: dbo.Trace) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"generate_rank{rank}.json")]
    timeline.save(paths[0], f"rank {rank}")
    try:
        paths.append(os.path.join(out, f"generate_rank{rank}.png"))
        timeline.plot(paths[1], f"one DBO generation, rank {rank}")
    except ImportError:
        paths.pop()
    return paths


def _summarize(
    args: argparse.Namespace, results: dict[str, list[tuple[float, float, float]]],
    tokens: dict[str, torch.Tensor], device: torch.device, world_size: int,
) -> dict[str, Any]:
    """Medians over the repeats of each rank's times, the slowest rank's; the token checks."""
    local = [statistics.median(run[i] for run in results[mode]) for mode in MODES for i in range(3)]
    equal = [float(torch.equal(tokens["dbo"], tokens["whole"])),
             float(torch.equal(tokens["dbo"], tokens["split"]))]
    gathered = _harness.gather(local + equal, device)
    slowest = gathered[:, :9].max(dim=0).values.view(3, 3).tolist()
    prefill = {mode: slowest[i][0] for i, mode in enumerate(MODES)}
    decode = {mode: slowest[i][1] for i, mode in enumerate(MODES)}
    total = {mode: slowest[i][2] for i, mode in enumerate(MODES)}
    new_tokens = args.batch * args.new_tokens * world_size
    return {
        "model": args.model, "world_size": world_size, "backend": dist.get_backend(),
        "device": device.type, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "cache": args.cache, "repeats": args.repeats,
        "tokens_equal": bool(gathered[:, 9].all()),
        "tokens_equal_split": bool(gathered[:, 10].all()),
        "prefill_ms": prefill, "decode_ms_per_token": decode, "generate_ms": total,
        "tokens_per_s": {mode: new_tokens / (total[mode] / 1e3) for mode in MODES},
        "decode_speedup": decode["whole"] / decode["dbo"],
        "decode_speedup_vs_split": decode["split"] / decode["dbo"],
        "prefill_speedup_vs_split": prefill["split"] / prefill["dbo"],
    }


def _report(args: argparse.Namespace, summary: dict[str, Any], files: list[str]) -> None:
    print(
        f"generate: {summary['model']} ({args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts, top-{args.topk}), {summary['batch']} prompts of "
        f"{summary['prompt_len']} tokens per rank, {summary['new_tokens']} new tokens, "
        f"{summary['cache']} cache"
    )
    print(f"  world: {summary['world_size']} ranks, {summary['backend']} on {summary['device']}, "
          "experts sharded over the ranks")
    print(f"  tokens equal, DBO vs whole batch: {summary['tokens_equal']}; "
          f"vs the same ubatches in turn: {summary['tokens_equal_split']}")
    print(f"  medians of {summary['repeats']} runs, slowest rank; forward host time")
    print(f"    {'mode':<24}{'prefill ms':>11}{'decode ms/token':>17}{'tokens/s':>10}")
    for mode in MODES:
        print(f"    {LABELS[mode]:<24}{summary['prefill_ms'][mode]:>11.1f}"
              f"{summary['decode_ms_per_token'][mode]:>17.2f}{summary['tokens_per_s'][mode]:>10.0f}")
    print(f"  decode: DBO {summary['decode_speedup_vs_split']:.2f}x over the same ubatches in "
          f"turn, {summary['decode_speedup']:.2f}x over the whole batch; prefill: "
          f"{summary['prefill_speedup_vs_split']:.2f}x over the ubatches in turn")
    copies = summary["cache_bytes_per_decode_step"]
    if copies is not None:
        print(f"  KV cache bytes written per decode step (rank 0): transformers' DynamicCache "
              f"{copies['transformers'] / 1e3:.1f} kB, dbo's split one "
              f"{copies['dbo'] / 1e3:.1f} kB")
    print(f"  trace and timeline of one DBO generation (rank 0): {', '.join(files)}")
    if args.json:
        print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS,
                        default="qwen3_moe", help="the transformers model family")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="prompts per rank (default 64)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (32)")
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                        help="the KV cache kind (default dynamic)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="the fixed-shape MoE path with this many rows per (rank, expert); "
                             "default: the dynamic path")
    parser.add_argument("--repeats", type=int, default=5,
                        help="generations per mode, interleaved (default 5)")
    parser.add_argument("--min-prefill-tokens", type=int,
                        default=dbo.hf.DEFAULT_MIN_PREFILL_TOKENS,
                        help="overlap a prefill from this many tokens (default %(default)s)")
    parser.add_argument("--min-decode-tokens", type=int, default=dbo.hf.DEFAULT_MIN_DECODE_TOKENS,
                        help="overlap a decode step from this many rows (default %(default)s)")
    _harness.add_common_args(parser, default_out="dbo-demo-generate")
    _harness.launch(rank_main, parser.parse_args())


if __name__ == "__main__":
    main()
