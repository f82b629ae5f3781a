"""`model.generate` under DBO, expert-parallel over 2 and 4 gloo ranks: token-identical to
`generate` without DBO on the same sharded model, with ranks holding different batch
sizes, left-padded prompts, rows stopping at EOS (`synced_gpus=True` keeps every rank
stepping) and both cache kinds."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _spawn import expect_ok, run_world

import comm
import dbo

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_generation_checks import eos_that_stops_row_zero, generate, prompts, tiny_model  # noqa: E402


def _record(ubatches: set[int], module: torch.nn.Module, args: tuple) -> None:
    if args[0].shape[1] == 1:  # a decode step
        ubatches.add(dbo.current_ubatch_id())


def _check_generation_matches(kinds: list[str], new_tokens: int) -> list[str]:
    rank, world_size, _ = comm.init_distributed(timeout_s=60)
    group = torch.distributed.group.WORLD
    checked = []
    for kind in kinds:
        model = tiny_model(kind, num_experts=4)
        comm.moe.shard_experts(model)
        dbo.yield_between(model.model.layers)
        ubatches_in_decode: set[int] = set()
        record = functools.partial(_record, ubatches_in_decode)
        model.model.layers[0].register_forward_pre_hook(record)
        ids, mask = prompts(3 + rank, 5 + rank % 2, seed=10 + rank)  # each rank its own batch
        # greedy with one cache kind, sampling with the other (the one-process tests run
        # every pairing); DeepSeek-V4 has no StaticCache
        static = "dynamic" if kind == "deepseek_v4" else "static"
        for cache, sample in (("dynamic", False), (static, True)):
            options = dict(max_new_tokens=new_tokens, synced_gpus=True, cache_implementation=cache,
                           do_sample=sample)
            eos = eos_that_stops_row_zero(model, ids, mask, **options)
            expected = generate(model, ids, mask, eos_token_id=eos, **options)
            with dbo.hf.overlap_generation(
                model, min_prefill_tokens=0, min_decode_tokens=0, decision_group=group,
                timeout_s=30,
            ):
                got = generate(model, ids, mask, eos_token_id=eos, **options)
            assert torch.equal(got, expected), (rank, kind, cache, sample)
            assert ubatches_in_decode == {0, 1}, ubatches_in_decode
            ubatches_in_decode.clear()
            checked.append(f"{kind}/{cache}/{'sample' if sample else 'greedy'}")
    comm.destroy_distributed()
    return checked


@pytest.mark.timeout(300)
def test_generation_over_two_ranks_is_token_identical_for_seven_moe_families() -> None:
    # GPT-OSS: sliding windows; Nemotron-H: Mamba states; DeepSeek-V3.2: sparse attention;
    # DeepSeek-V4: compressed attention of its own (a DynamicCache only)
    kinds = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "nemotron_h", "deepseek_v32",
             "deepseek_v4"]
    results = expect_ok(run_world(_check_generation_matches, world_size=2,
                                  args=(kinds, 16), timeout_s=270))
    assert all(len(checked) == 14 for checked in results)


@pytest.mark.timeout(300)
def test_generation_over_four_ranks_is_token_identical() -> None:
    results = expect_ok(run_world(_check_generation_matches, world_size=4,
                                  args=(["qwen3_moe"], 16), timeout_s=270))
    assert all(len(checked) == 2 for checked in results)


@pytest.mark.timeout(240)
def test_the_generate_example_checks_the_tokens_and_reports_json(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
    completed = subprocess.run(
        [sys.executable, str(example), "--spawn", "2", "--batch", "6", "--new-tokens", "4",
         "--repeats", "1", "--min-prefill-tokens", "0", "--min-decode-tokens", "0",
         "--timeout-s", "60", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=200,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"] is True and result["tokens_equal_split"] is True
    assert result["batch"] == 6 and result["new_tokens"] == 4 and result["world_size"] == 2
    for key in ("prefill_ms", "decode_ms_per_token", "tokens_per_s"):
        assert set(result[key]) == {"whole", "split", "dbo"} and min(result[key].values()) > 0
    for key in ("decode_speedup", "decode_speedup_vs_split", "prefill_speedup_vs_split"):
        assert result[key] > 0, key
    copies = result["cache_bytes_per_decode_step"]
    assert 0 < copies["dbo"] < copies["transformers"], copies
    for rank in (0, 1):
        events = json.loads((tmp_path / f"generate_rank{rank}.json").read_text())["traceEvents"]
        assert {"dbo.overlap", "baton"} <= {e["name"] for e in events if e["ph"] == "X"}
        assert (tmp_path / f"generate_rank{rank}.png").stat().st_size > 0
