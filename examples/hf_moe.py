"""A Hugging Face MoE model, expert-parallel over the ranks, run serially and with DBO.

    # one node, 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/hf_moe.py
    # several nodes: run on each node, with its own --node-rank
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
             --nproc-per-node 8 examples/hf_moe.py
    # no torchrun (a fresh machine, `make demo-hf`): spawn 2 gloo ranks on a free port
    python examples/hf_moe.py --spawn 2

A tiny random-weight Qwen3-MoE (`--model`: also Qwen2-MoE, Mixtral, DeepSeek-V3 or
GPT-OSS) is built from its `transformers` config, the same on every rank (no hub access;
with a checkpoint, load it with `from_pretrained` first).
`comm.moe.shard_experts(model)` keeps each rank's share of the experts and routes the
tokens through `comm.moe.dispatch`/`combine`, which yield to the other ubatch while in
flight; `dbo.yield_between(model.model.layers)` passes the baton between the decoder
layers too; `dbo.overlap(model, no_split=["position_ids"])` splits the batch of
sequences into two ubatches and gives both the [1, S] positions whole. The checks, the
table and the traces are those of `examples/moe_overlap.py`. Needs `transformers` (the
`hf` extra).
"""

from __future__ import annotations

import argparse
from typing import Any

import _harness
import torch

import comm
import dbo

MODELS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]


def build_model(
    kind: str, layers: int, hidden: int, experts: int, topk: int, vocab: int
) -> torch.nn.Module:
    """A random-weight MoE causal LM of `kind` (one of `MODELS`) from its config, the same
    weights on every rank; 4 heads, so `hidden` % 4 == 0 (DeepSeek-V3: % 8)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=topk, use_cache=False,  # forward passes only: no KV cache
    )
    if kind == "mixtral":
        config: Any = transformers.MixtralConfig(num_local_experts=experts, **common)
        model_type: Any = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_experts=experts, moe_intermediate_size=hidden,
            shared_expert_intermediate_size=2 * hidden, **common,
        )
        model_type = transformers.Qwen2MoeForCausalLM
    elif kind == "deepseek_v3":  # a shared expert, group-limited routing, latent attention
        common["num_key_value_heads"] = 4
        rope, groups = hidden // 8, 2 if experts % 2 == 0 else 1
        config = transformers.DeepseekV3Config(
            n_routed_experts=experts, moe_intermediate_size=hidden, n_group=groups,
            topk_group=1, first_k_dense_replace=0, kv_lora_rank=hidden // 2,
            q_lora_rank=hidden // 2, qk_rope_head_dim=rope, qk_nope_head_dim=rope,
            v_head_dim=rope, **common,
        )
        model_type = transformers.DeepseekV3ForCausalLM
    elif kind == "gpt_oss":  # biases in the router and the experts, 16-token windows
        common["intermediate_size"] = hidden
        config = transformers.GptOssConfig(
            num_local_experts=experts, head_dim=hidden // 4, sliding_window=16, **common
        )
        model_type = transformers.GptOssForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            num_experts=experts, moe_intermediate_size=hidden, head_dim=hidden // 4, **common
        )
        model_type = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return model_type(config).eval()


def rank_main(args: argparse.Namespace) -> None:
    """One rank's work: build and shard the model, then compare the three modes."""
    rank, world_size, device = comm.init_distributed()  # launched by `_harness.launch`
    model = build_model(args.model, args.layers, args.hidden, args.experts, args.topk, args.vocab)
    blocks = comm.moe.shard_experts(model.to(device))
    if args.yield_between:
        dbo.yield_between(model.model.layers)
    generator = torch.Generator().manual_seed(1234 + rank)  # each rank its own batch
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0)  # [1, S], every row
    step = dbo.overlap(model, no_split=["position_ids"])

    def split_serial() -> torch.Tensor:
        """The two ubatches one after the other: the same work as DBO, no overlap."""
        parts = ids.tensor_split(2)
        return torch.cat([model(part, position_ids=positions).logits for part in parts])

    _harness.compare(
        f"{type(model).__name__} forward", whole=lambda: model(ids, position_ids=positions).logits,
        split=split_serial, overlapped=lambda: step(ids, position_ids=positions).logits,
        args=args, device=device,
        facts={
            "tokens": args.batch * args.seq, "num_ubatches": 2, "model": type(model).__name__,
            "layers": args.layers, "hidden": args.hidden, "experts": args.experts,
            "experts_per_rank": args.experts // world_size, "topk": args.topk,
            "sharded_blocks": len(blocks), "yield_between": args.yield_between,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=MODELS, default="qwen3_moe",
        help="the transformers model family (default qwen3_moe)",
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    parser.add_argument(
        "--experts", type=int, default=8, help="experts per layer, over all ranks (default 8)"
    )
    parser.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank (default 16)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument(
        "--no-yield-between", dest="yield_between", action="store_false",
        help="no yield points between the decoder layers (only those of dispatch/combine)",
    )
    _harness.add_common_args(parser, default_out="dbo-demo-hf")
    _harness.launch(rank_main, parser.parse_args())


if __name__ == "__main__":
    main()
