"""Hugging Face MoE models over two gloo ranks: `comm.moe.shard_experts` equals the
unsharded model (outputs and gradients) for the example's five families, and
`examples/hf_moe.py` runs end to end."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _spawn import expect_ok, run_world

import comm

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from hf_moe import MODELS, build_model  # noqa: E402

ROWS_PER_RANK = 2


def _check_sharded_models_equal_the_unsharded_ones() -> list[str]:
    rank, world_size, _ = comm.init_distributed(timeout_s=60)
    try:
        comm.moe.shard_experts(build_model("mixtral", 1, 32, 3, 2, 64))
    except ValueError as error:
        assert "3 experts, which do not split evenly over the 2 ranks" in str(error)
    else:
        raise AssertionError("3 experts over 2 ranks were sharded")
    checked = []
    for kind in MODELS:
        model = build_model(kind, 2, 32, 4, 2, 64)
        reference = copy.deepcopy(model)
        blocks = comm.moe.shard_experts(model)
        # Every rank builds the whole batch; rank r runs its rows, the reference all of them.
        ids = torch.randint(0, 64, (ROWS_PER_RANK * world_size, 6),
                            generator=torch.Generator().manual_seed(7))
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        got, expected = model(ids[mine]).logits, reference(ids).logits
        torch.testing.assert_close(got, expected[mine], msg=kind)
        (got * got).sum().backward()
        (expected * expected).sum().backward()
        grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            want = grads[name].grad
            assert want is not None, name
            if any(name.startswith(f"{block}.experts.") for block in blocks):
                local = param.shape[0]  # this rank's experts: its slice of the reference's
                assert local * world_size == want.shape[0], name
                want = want[rank * local:(rank + 1) * local]
            else:  # replicated: the ranks' gradients add up to the whole batch's
                torch.distributed.all_reduce(param.grad)
            torch.testing.assert_close(param.grad, want, msg=f"{kind} {name}")
        checked.append(kind)
    return checked


@pytest.mark.timeout(180)  # two processes importing transformers on a loaded machine
def test_sharded_models_over_two_ranks_equal_the_unsharded_ones_with_gradients() -> None:
    results = expect_ok(run_world(_check_sharded_models_equal_the_unsharded_ones,
                                  world_size=2, timeout_s=150))
    assert results == [MODELS] * 2


@pytest.mark.timeout(180)
def test_the_hf_example_matches_serial_and_reports_json(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable, str(EXAMPLES / "hf_moe.py"), "--spawn", "2", "--batch", "4",
            "--seq", "8", "--steps", "2", "--timeout-s", "60", "--out", str(tmp_path), "--json",
        ],
        capture_output=True, text=True, timeout=150,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["num_ubatches"] == 2
    assert result["tokens"] == 32 and result["model"] == "Qwen3MoeForCausalLM"
    assert result["sharded_blocks"] == 2 and result["experts_per_rank"] == 4
    assert result["bitwise_equal"] is True and result["allclose_vs_unsplit"] is True
    assert result["max_abs_diff_vs_unsplit"] < 1e-4
    for key in ("serial_ms", "split_ms", "dbo_ms", "speedup", "speedup_vs_split"):
        assert result[key] > 0, key
    assert result["blocked_split_ms"] >= 0 and result["blocked_dbo_ms"] >= 0
    for rank in (0, 1):
        events = json.loads((tmp_path / f"dbo_rank{rank}.json").read_text())["traceEvents"]
        names = {event["name"] for event in events if event["ph"] == "X"}
        assert {"dbo.overlap", "wait all_to_all_single"} <= names, names
        assert (tmp_path / f"dbo_rank{rank}.png").stat().st_size > 0
