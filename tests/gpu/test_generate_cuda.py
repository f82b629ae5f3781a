"""`generate` under `dbo.hf.overlap_generation` on CUDA, where each ubatch queues its cache
writes on its own streams: token-identical for every kind of cache layer dbo splits
(sliding windows, Mamba states beside attention, sparse-attention indexer keys,
DeepSeek-V4's compressed attention), with both cache kinds (DeepSeek-V4: the dynamic one,
it has no other). Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_generation_checks import (  # noqa: E402
    both,
    prompts,
    skip_unless_tested_transformers,
    tiny_model,
)

skip_unless_tested_transformers()

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["gpt_oss", "nemotron_h", "deepseek_v32", "deepseek_v4"])
def test_generation_on_cuda_is_token_identical_for_every_kind_of_cache_layer(kind: str) -> None:
    model = tiny_model(kind).to("cuda")
    ids, mask = (tensor.to("cuda") for tensor in prompts(6, 7, seed=2))
    overlap = dict(min_prefill_tokens=0, min_decode_tokens=0, timeout_s=60)
    for cache in ("dynamic",) if kind == "deepseek_v4" else ("dynamic", "static"):
        expected, got = both(model, ids, mask, overlap, max_new_tokens=12, do_sample=False,
                             cache_implementation=cache)
        assert got.device.type == "cuda"
        assert torch.equal(got, expected), (kind, cache)
