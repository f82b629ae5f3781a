"""Shared by the generation tests (one process and several ranks): tiny random-weight
Hugging Face models, left-padded prompts, and `generate` with and without DBO."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import dbo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import generate as generate_example  # noqa: E402 - the generation example
from hf_moe import build_model  # noqa: E402 - the example's builder

VOCAB = 64
PAD = 0
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss",
         "nemotron_h", "qwen2", "mistral", "mamba", "falcon_h1"]
"""MoE ones and dense ones; GPT-OSS (alternating) and Mistral (every layer) attend through
sliding windows of `WINDOW` tokens, which a prompt and a few new tokens overflow; Mamba's
layers keep linear-attention (conv and recurrent) states, and Nemotron-H has a Mamba, an
MoE, an attention and an MLP layer; Falcon-H1's layers hold attention keys and Mamba
states both; DeepSeek-V3.2's sparse attention keeps indexer keys and attends to the
`SPARSE_TOPK` tokens they select."""
SPARSE_TOPK = 4
DEEPSEEK_V4_RATES = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}
"""DeepSeek-V4's layers compress every 2 or 4 tokens into one entry (a prompt and a few new
tokens close several windows), attending to the `SPARSE_TOPK` entries the indexer picks."""
WINDOW = 4
SLIDING = ("gpt_oss", "mistral")


def skip_unless_tested_transformers() -> None:
    """Skip the calling test module unless `transformers` is one of dbo's tested releases
    (a GPU machine's own may be older: `benchmarks/gpu_check.sh` carries a tested one)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from dbo.hf.versions import TESTED_TRANSFORMERS, is_tested

    if not is_tested(transformers.__version__):
        pytest.skip(f"transformers {transformers.__version__} is not one of dbo's tested "
                    f"releases ({' to '.join(TESTED_TRANSFORMERS)})", allow_module_level=True)


def tiny_model(kind: str, num_experts: int = 4) -> torch.nn.Module:
    """A 2-layer random-weight causal LM of `kind`, generating with a KV cache."""
    import transformers

    dense = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**dense)).eval()
    elif kind == "mistral":
        config = transformers.MistralConfig(sliding_window=WINDOW, **dense)
        model = transformers.MistralForCausalLM(config).eval()
    elif kind == "mamba":
        config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                          num_hidden_layers=2)
        model = transformers.MambaForCausalLM(config).eval()
    elif kind == "nemotron_h":
        config = transformers.NemotronHConfig(
            hybrid_override_pattern="ME*-", mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
            ssm_state_size=8, head_dim=8, n_routed_experts=num_experts, num_experts_per_tok=2,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1,
            topk_group=1, **dense,
        )
        model = transformers.NemotronHForCausalLM(config).eval()
    elif kind == "falcon_h1":  # every layer holds attention keys and Mamba states
        config = transformers.FalconH1Config(
            mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_chunk_size=8, head_dim=8, **dense,
        )
        model = transformers.FalconH1ForCausalLM(config).eval()
    elif kind == "deepseek_v32":
        config = transformers.DeepseekV32Config(
            n_routed_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=32,
            n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16,
            index_topk=SPARSE_TOPK, mlp_layer_types=["dense", "sparse"],
            **{**dense, "num_key_value_heads": 4},
        )
        model = transformers.DeepseekV32ForCausalLM(config).eval()
    elif kind == "deepseek_v4":  # windows, compressor buffers and compressed entries per row
        config = transformers.DeepseekV4Config(
            n_routed_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=32,
            head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=16, o_groups=2,
            index_n_heads=2, index_head_dim=16, index_topk=SPARSE_TOPK, sliding_window=WINDOW,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe"], compress_rates=DEEPSEEK_V4_RATES,
            **{**dense, "num_key_value_heads": 1},
        )
        model = transformers.DeepseekV4ForCausalLM(config).eval()
    elif kind in ("minimax", "minimax_linear"):  # states in a cache class of its own
        config = transformers.MiniMaxConfig(
            num_local_experts=num_experts, num_experts_per_tok=2, head_dim=8, block_size=4,
            layer_types=["linear_attention", "full_attention" if kind == "minimax" else
                         "linear_attention"], **dense,
        )
        model = transformers.MiniMaxForCausalLM(config).eval()
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(
            num_local_experts=num_experts, num_experts_per_tok=2, head_dim=8,
            sliding_window=WINDOW, **{**dense, "intermediate_size": 32},
        )
        model = transformers.GptOssForCausalLM(config).eval()
    else:
        model = build_model(kind, layers=2, hidden=32, experts=num_experts, topk=2, vocab=VOCAB)
    model.generation_config.use_cache = True
    model.generation_config.pad_token_id = PAD
    return model


def prompts(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The generation example's left-padded prompts (pad id `PAD`) and their mask."""
    return generate_example.prompts(rows, length, VOCAB, seed, torch.device("cpu"))


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **options: Any):
    """`model.generate` with a fixed sampling seed (the same draws with and without DBO)."""
    torch.manual_seed(1234)
    return model.generate(ids, attention_mask=mask, **options)


def both(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, overlap_options: dict,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens without DBO, tokens under `dbo.hf.overlap_generation`)."""
    expected = generate(model, ids, mask, **options)
    with dbo.hf.overlap_generation(model, **overlap_options):
        got = generate(model, ids, mask, **options)
    return expected, got


def eos_that_stops_row_zero(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                            **options: Any) -> int:
    """A token id row 0 generates on its third step (so it stops there, others go on)."""
    tokens = generate(model, ids, mask, **options)
    return int(tokens[0, ids.shape[1] + 2])
