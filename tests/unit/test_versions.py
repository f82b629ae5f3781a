"""The version contract: pyproject declares the tested ranges, constraints.txt pins
releases inside them, and outside the tested transformers releases `dbo.hf` refuses by
name (generation and the cache split rule) unless DBO_ALLOW_UNTESTED_VERSIONS=1, which
warns once per process."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import tomllib
import torch

import dbo
from dbo.hf import versions

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINS = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(),
                       re.MULTILINE))


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_pyproject_declares_the_tested_transformers_range_for_every_extra_that_installs_it(
) -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    declared = [spec for extra in ("hf", "test") for spec in extras[extra]
                if spec.startswith("transformers")]
    assert declared == [f"transformers{versions.pip_spec()}"] * 2


def test_the_pins_are_inside_the_declared_ranges() -> None:
    assert versions.is_tested(PINS["transformers"]), PINS["transformers"]
    (torch_spec,) = PYPROJECT["project"]["dependencies"]
    low, high = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch_spec).groups()  # type: ignore[union-attr]
    assert _minor(low) <= _minor(PINS["torch"]) < _minor(high)
    for name in ("torch", "transformers", "mypy", "ruff", "pytest", "hypothesis",
                 "matplotlib", "numpy"):
        assert name in PINS, f"constraints.txt pins no {name}"


@pytest.mark.parametrize(("version", "tested"), [
    ("5.24.0", True), ("5.25.3", True), ("5.25", True), ("5.23.1", False), ("5.26.0", False),
    ("5.26.0.dev0", False), ("5.25.0rc1", False), ("6.0.0", False), ("4.57.6", False),
])
def test_a_release_is_tested_when_its_minor_is_in_the_range(
    version: str, tested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "TESTED_TRANSFORMERS", ("5.24", "5.25"))
    assert versions.is_tested(version) is tested


def test_an_untested_release_is_refused_naming_it_the_range_and_the_way_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(versions.ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(versions, "TESTED_TRANSFORMERS", ("5.24", "5.25"))
    with pytest.raises(dbo.hf.UntestedVersionError) as raised:
        versions.check_transformers("5.26.0")
    message = str(raised.value)
    for part in ("transformers 5.26.0", "5.24.x to 5.25.x", "DBO_ALLOW_UNTESTED_VERSIONS=1",
                 "python -m dbo.hf.check --family", "transformers>=5.24,<5.26"):
        assert part in message, message


def test_allowing_untested_releases_warns_once_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(versions.ALLOW_UNTESTED, "1")
    monkeypatch.setattr(versions, "_checked", set())
    monkeypatch.setattr(versions, "TESTED_TRANSFORMERS", ("5.24", "5.25"))
    with pytest.warns(RuntimeWarning, match="transformers 5.26.0, outside its tested"):
        versions.check_transformers("5.26.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_transformers("5.26.0")  # once per process: no second warning


def _pretend_untested(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.99.0 installed, as far as dbo can tell (set after the models are
    built: loading a model's module sets the real `__version__` again)."""
    import transformers

    monkeypatch.delenv(versions.ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr(versions, "_checked", set())
    monkeypatch.setattr(transformers, "__version__", "5.99.0")


def test_overlap_generation_refuses_an_untested_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.Qwen2ForCausalLM(config).eval()
    _pretend_untested(monkeypatch)
    with pytest.raises(dbo.hf.UntestedVersionError, match="transformers 5.99.0"):
        dbo.hf.overlap_generation(model)
    assert "forward" not in model.__dict__  # nothing installed


def test_the_cache_split_rule_refuses_an_untested_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    _pretend_untested(monkeypatch)
    step = dbo.overlap(lambda x, cache: x * 2, timeout_s=30)
    with pytest.raises(dbo.hf.UntestedVersionError, match="transformers 5.99.0"):
        step(torch.ones(4, 2), cache)
    monkeypatch.setenv(versions.ALLOW_UNTESTED, "1")
    with pytest.warns(RuntimeWarning, match="5.99.0"):
        assert torch.equal(step(torch.ones(4, 2), cache), torch.full((4, 2), 2.0))
