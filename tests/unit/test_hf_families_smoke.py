"""`dbo.hf.check` and `benchmarks/hf_families.py`: the check finds families generating the
same tokens under DBO (Gemma 2's sliding windows, Inkling's windows beside Mamba-like
states in one layer, MiniMax's cache class of its own), with either cache kind, and a
training step's gradients the same (WRONG when they differ); `python -m dbo.hf.check`
runs every check of a family and exits 1 on a WRONG one; the survey runs each family in
a process of its own (a hybrid with a config of its own among them) and reports them in
its --json; with --shard it checks `comm.moe.shard_experts`, gradients included, in a
world of 2 ranks (in-process: a world of one), on the fixed-shape path with --capacity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dbo

pytest.importorskip("transformers")
from dbo.hf import check  # noqa: E402 - after the skip: it needs transformers to run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_families.py"
sys.path.insert(0, str(SCRIPT.parent))

import hf_families  # noqa: E402 - the survey script


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["qwen2_moe", "gemma2", "inkling_text", "minimax"])
def test_the_survey_finds_the_family_the_same_under_dbo(kind: str, cache: str) -> None:
    assert check.check_generation(kind, cache) == {"outcome": "equal"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["qwen2_moe", "gemma2", "granitemoehybrid", "deepseek_v4"])
def test_the_training_survey_finds_the_family_s_gradients_the_same_under_dbo(kind: str) -> None:
    assert check.check_train(kind) == {"outcome": "equal"}


@pytest.mark.timeout(120)
def test_the_training_survey_reports_gradients_a_thousandth_off_as_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    overlap = dbo.overlap

    def off(model: object, **options: object) -> object:
        def step(*args: object, **kwargs: object) -> object:
            output = overlap(model, **options)(*args, **kwargs)
            output.logits = output.logits * 1.001
            return output
        return step

    monkeypatch.setattr(dbo, "overlap", off)
    assert check.check_train("qwen2_moe") == {"outcome": "WRONG"}


@pytest.mark.timeout(120)
def test_the_check_command_runs_every_check_of_a_family_and_exits_1_on_a_wrong_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DBO_ALLOW_UNTESTED_VERSIONS", "0")  # main sets it: restored after
    assert check.main(["--family", "gemma2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["families"] == {"gemma2": {name: {"outcome": "equal"}
                                             for name in ("dynamic", "static", "train")}}
    monkeypatch.setitem(check.CHECKS, "train", lambda kind: {"outcome": "WRONG"})
    assert check.main(["--family", "gemma2", "--checks", "train"]) == 1
    with pytest.raises(SystemExit):
        check.main(["--family", "gemma2", "--checks", "dynamic,prefill"])


@pytest.mark.timeout(240)
def test_the_survey_runs_each_family_apart_and_reports_them_in_its_json() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "gemma2,granitemoehybrid", "--cache", "static",
         "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    assert result["families"] == {"gemma2": {"outcome": "equal"},
                                  "granitemoehybrid": {"outcome": "equal"}}, result
    assert result["counts"] == {"equal": 2}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("capacity", "outcome"), [(None, "equal"), (48, "equal"), (1, "WRONG")])
def test_the_shard_survey_in_a_world_of_one_finds_what_a_capacity_drops(
    capacity: int | None, outcome: str, world_of_one: None
) -> None:
    """Room for every (token, expert) pair: the same logits and gradients; room for one:
    rows dropped."""
    assert hf_families.check_sharded("qwen2_moe", capacity) == {"outcome": outcome}


@pytest.mark.timeout(240)
def test_the_shard_survey_checks_a_family_sharded_over_two_ranks() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--shard", "--only", "hunyuan_v1_moe", "--json"],
        capture_output=True, text=True, timeout=230,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.splitlines()[-1])
    assert result["families"] == {"hunyuan_v1_moe": {"outcome": "equal"}}, result
