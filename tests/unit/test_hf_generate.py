"""`model.generate` under DBO in one process: token-identical to `generate` without it,
with each ubatch on its own rows of the KV cache (`dbo.hf`, `dbo.hf.cache`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dbo

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_generation_checks import (  # noqa: E402
    KINDS,
    SLIDING,
    WINDOW,
    both,
    eos_that_stops_row_zero,
    generate,
    prompts,
    tiny_model,
)

ALWAYS = dict(min_prefill_tokens=0, min_decode_tokens=0, timeout_s=30)


@pytest.mark.parametrize("rows", range(2, 10))
def test_a_wrapped_forward_under_generate_gives_the_tokens_of_generate_without_dbo(
    rows: int,
) -> None:
    """A user's first try: model.forward = dbo.overlap(model.forward), then generate."""
    model = tiny_model("qwen2_moe")
    ids, mask = prompts(rows, 6, seed=rows)
    expected = generate(model, ids, mask, max_new_tokens=8, do_sample=False)
    model.forward = dbo.overlap(model.forward, timeout_s=30)
    got = generate(model, ids, mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_overlap_generation_is_token_identical_greedy_and_sampled_with_rows_stopping(
    kind: str, cache: str
) -> None:
    model = tiny_model(kind)
    ids, mask = prompts(5, 7, seed=3)
    options: dict[str, Any] = dict(max_new_tokens=32, cache_implementation=cache)
    for sample in (False, True):
        eos = eos_that_stops_row_zero(model, ids, mask, do_sample=sample, **options)
        expected, got = both(model, ids, mask, ALWAYS, do_sample=sample, eos_token_id=eos,
                             **options)
        assert torch.equal(got, expected), (kind, cache, sample)
        assert got.shape[1] > ids.shape[1] + 3, "every row stopped at once"
        assert (got[0, ids.shape[1] + 3:] == 0).all(), "row 0 did not stop at its EOS"


def test_both_ubatches_run_in_prefill_and_in_every_decode_step() -> None:
    model = tiny_model("qwen3_moe")
    seen: list[tuple[int, int, int]] = []

    def record(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((dbo.current_ubatch_id(), hidden.shape[0], hidden.shape[1]))

    hook = model.model.layers[0].register_forward_pre_hook(record, with_kwargs=True)
    ids, mask = prompts(5, 6, seed=0)
    with dbo.hf.overlap_generation(model, **ALWAYS):
        generate(model, ids, mask, max_new_tokens=4, do_sample=False)
    hook.remove()
    prefill = [(ubatch, rows) for ubatch, rows, length in seen if length == 6]
    decode = [(ubatch, rows) for ubatch, rows, length in seen if length == 1]
    assert sorted(prefill) == [(0, 3), (1, 2)]
    assert sorted(decode) == [(0, 3)] * 3 + [(1, 2)] * 3


def test_thresholds_pick_the_path_per_step_and_the_cache_carries_across_paths() -> None:
    model = tiny_model("mixtral")
    ids, mask = prompts(4, 6, seed=5)
    runs: list[bool] = []

    def record(module: torch.nn.Module, args: Any) -> None:
        runs.append(dbo.enabled())

    model.model.layers[0].register_forward_pre_hook(record)
    for cache in ("dynamic", "static"):
        options = dict(max_new_tokens=6, do_sample=False, cache_implementation=cache)
        # Prefill overlapped (24 tokens >= 20), decode inline (4 rows < 5), and the reverse.
        for prefill, decode, want in ((20, 5, [True] * 2 + [False] * 5),
                                      (25, 4, [False] + [True] * 10)):
            runs.clear()
            expected, got = both(model, ids, mask, dict(
                min_prefill_tokens=prefill, min_decode_tokens=decode, timeout_s=30), **options)
            assert torch.equal(got, expected), (cache, prefill, decode)
            assert runs[len(runs) - len(want):] == want, (cache, runs)


def test_the_cache_generate_returns_equals_the_one_without_dbo() -> None:
    model = tiny_model("qwen2_moe")
    ids, mask = prompts(3, 5, seed=2)
    for cache in ("dynamic", "static"):
        options = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                       cache_implementation=cache)
        expected, got = both(model, ids, mask, ALWAYS, **options)
        assert torch.equal(got.sequences, expected.sequences)
        assert int(got.cache.get_seq_length()) == int(expected.cache.get_seq_length())
        for mine, theirs in zip(got.cache.layers, expected.cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys)
            torch.testing.assert_close(mine.values, theirs.values)


def _layer_state(layer: Any) -> dict[str, Any]:
    """What a cache layer holds: its tensors and its lengths and flags, by name."""
    state = {name: getattr(layer, name) for name in (
        "keys", "values", "indexer_keys", "cumulative_length", "cumulative_length_int",
        "indexer_cumulative_length", "has_previous_state") if hasattr(layer, name)}
    for name in ("conv_states", "recurrent_states", "buffer_kv", "buffer_gate", "compressed_kv",
                 "overlap_kv", "overlap_gate", "entry_count"):  # the last five: DeepSeek-V4's
        state.update({f"{name}[{index}]": states
                      for index, states in getattr(layer, name, {}).items()})
    return state


def _assert_same_cache_states(mine: Any, theirs: Any) -> None:
    """The per-row states a cache class of a model's own keeps (MiniMax's list)."""
    states = getattr(theirs, "linear_cache", [])
    assert len(getattr(mine, "linear_cache", [])) == len(states)
    for got, expected in zip(getattr(mine, "linear_cache", []), states):
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(got, expected)
        else:
            assert got == expected


@pytest.mark.parametrize(("kind", "cache"), [
    *((kind, cache) for kind in (*SLIDING, "mamba", "nemotron_h", "falcon_h1", "deepseek_v32")
      for cache in ("dynamic", "static")),
    ("deepseek_v4", "dynamic"),  # its layers are its own, and no StaticCache has them
    ("minimax", "dynamic"),  # its cache class is its own: linear-attention states in a list
    ("minimax_linear", "dynamic"),  # no layer but those states
])
def test_every_kind_of_layer_holds_what_generate_without_dbo_leaves(
    kind: str, cache: str,
) -> None:
    """Sliding windows (prompts shorter and longer than them), linear-attention states,
    indexer keys, DeepSeek-V4's compressor buffers and entries and MiniMax's states end as
    transformers' own layers leave them: the same tensors (up to the rounding of rows
    computed apart), lengths, counts and flags. No layer class of dbo's is left in
    transformers' mapping of layer types (making a layer class registers it there)."""
    model = tiny_model(kind)
    for length in (WINDOW - 2, WINDOW + 3):
        ids, mask = prompts(5, length, seed=length)
        options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                       cache_implementation=cache)
        expected, got = both(model, ids, mask, ALWAYS, **options)
        assert torch.equal(got.sequences, expected.sequences), length
        if kind in SLIDING and cache == "dynamic":
            windows = sum(layer.keys.nbytes + layer.values.nbytes
                          for layer in got.cache.layers if layer.is_sliding)
            # The last call alone: the layer's own torch.cat (window + 1), the joined window.
            assert dbo.hf.cache_bytes_written(got.cache) >= 2 * windows
        assert type(got.cache) is type(expected.cache)
        _assert_same_cache_states(got.cache, expected.cache)
        for mine, theirs in zip(got.cache.layers, expected.cache.layers):
            assert type(mine) is type(theirs)
            assert vars(mine).keys() == vars(theirs).keys()  # nothing of dbo's left on it
            mine, theirs = _layer_state(mine), _layer_state(theirs)
            assert mine.keys() == theirs.keys() and mine, (kind, cache)
            for name, value in theirs.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    torch.testing.assert_close(mine[name], value, msg=name)
                elif isinstance(value, torch.Tensor):
                    assert torch.equal(mine[name], value), name
                else:
                    assert mine[name] == value, name


def test_a_decode_step_writes_its_token_in_place_without_copying_the_cache_back() -> None:
    """The caller's DynamicCache holds views of one buffer per layer: a decode step adds
    its token there (the buffer's storage is the same) instead of concatenating it."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model("qwen3_moe")
    ids, mask = prompts(4, 6, seed=9)
    cache = transformers.DynamicCache(config=model.config)
    step = dbo.overlap(model.forward, timeout_s=30)
    with torch.no_grad():
        step(ids, attention_mask=mask, cache=cache, use_cache=True)
        storages = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
        token = ids[:, -1:]
        for length in range(7, 11):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = step(token, attention_mask=mask, cache=cache, use_cache=True).logits
            assert cache.get_seq_length() == length
            assert [layer.keys.untyped_storage().data_ptr() for layer in cache.layers] == storages
            token = logits[:, -1:].argmax(-1)


def test_a_new_batch_size_starts_over_and_remove_restores_the_model() -> None:
    model = tiny_model("qwen2")
    forward, compile_setting = model.forward, model.generation_config.disable_compile
    handle = dbo.hf.overlap_generation(model, **ALWAYS)
    assert model.forward is handle.forward and model.generation_config.disable_compile
    with pytest.raises(ValueError, match="already overlapped"):
        dbo.hf.overlap_generation(model)
    for rows in (4, 7, 3):
        ids, mask = prompts(rows, 5, seed=rows)
        handle.remove()
        expected = generate(model, ids, mask, max_new_tokens=4, do_sample=False)
        handle = dbo.hf.overlap_generation(model, **ALWAYS)
        assert torch.equal(generate(model, ids, mask, max_new_tokens=4, do_sample=False), expected)
    handle.remove()
    handle.remove()  # idempotent
    assert model.forward == forward and "forward" not in model.__dict__
    assert model.generation_config.disable_compile is compile_setting


def test_a_cache_of_an_unsupported_kind_is_refused_naming_it() -> None:
    transformers = pytest.importorskip("transformers")

    class OwnLayer(transformers.cache_utils.DynamicLayer):
        """A layer of the user's own: dbo cannot know what it keeps."""

    model = tiny_model("qwen2")
    cache = transformers.DynamicCache(config=model.config)
    cache.layers[1] = OwnLayer()
    ids, mask = prompts(4, 5, seed=0)
    step = dbo.overlap(model.forward, timeout_s=30)
    with pytest.raises(ValueError, match="OwnLayer layers.*use_cache=False"):
        step(ids, attention_mask=mask, cache=cache, use_cache=True)
    model = tiny_model("deepseek_v32")  # positions some models keep on indexed layers
    cache = transformers.DynamicCache(config=model.config)
    cache.layers[0].indexer_position_ids = torch.zeros(3, 4, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"DynamicIndexedLayer \(with indexer positions\)"):
        dbo.overlap(model.forward, timeout_s=30)(ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="rows but the batch has 4"):
        small = transformers.DynamicCache(config=model.config)
        model(ids[:2], attention_mask=mask[:2], cache=small, use_cache=True)
        step(ids, attention_mask=mask, cache=small, use_cache=True)


def _own_decode_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any,
                     new_tokens: int, fail_at: int | None = None,
                     overlapped: bool = True) -> torch.Tensor:
    """A decode loop of one's own: `dbo.overlap` (unless not `overlapped`) of a function
    that returns only the logits (not the cache); at step `fail_at` ubatch 1 raises after
    its forward, and the step is run again."""
    calls = [0]

    def logits_of(tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> Any:
        logits = model(tokens, attention_mask=attention_mask, cache=cache, use_cache=True).logits
        if calls[0] == fail_at and dbo.current_ubatch_id() == 1:
            raise KeyError("injected")
        return logits

    step = dbo.overlap(logits_of, timeout_s=30) if overlapped else logits_of
    rows, length = ids.shape
    full = torch.cat([mask, torch.ones(rows, new_tokens, dtype=mask.dtype)], dim=1)
    out, tokens = [ids], ids
    with torch.no_grad():
        for index in range(new_tokens):
            calls[0] = index
            try:
                logits = step(tokens, full[:, : length + index], cache)
            except KeyError:
                calls[0] = -1
                logits = step(tokens, full[:, : length + index], cache)
            tokens = logits[:, -1:].argmax(-1)
            out.append(tokens)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize(
    ("kind", "cache_kind"), [("qwen3_moe", "dynamic"), ("qwen3_moe", "static"),
                             ("mistral", "dynamic"),  # Mistral: sliding windows
                             ("deepseek_v4", "dynamic"),  # compressor states of its own
                             ("minimax", "dynamic")]  # a cache class of its own
)
def test_an_own_decode_loop_that_returns_only_logits_keeps_the_cache_right(
    kind: str, cache_kind: str,
) -> None:
    """The cache is brought up to date as the ubatches return, whether or not the function
    returns it; a call that raised leaves it as before, so the step can run again. (The
    loop passes no positions: DeepSeek-V4 then differs from generate, without dbo too.)"""
    transformers = pytest.importorskip("transformers")
    model = tiny_model(kind)
    ids, mask = prompts(5, 6, seed=4)

    def new_cache() -> Any:
        if cache_kind == "static":
            return transformers.StaticCache(config=model.config, max_cache_len=14)
        if kind == "minimax":
            return transformers.models.minimax.modeling_minimax.MiniMaxCache()
        return transformers.DynamicCache(config=model.config)

    reference = new_cache()
    expected = _own_decode_loop(model, ids, mask, reference, 8, overlapped=False)
    if kind != "deepseek_v4":
        assert torch.equal(expected, generate(model, ids, mask, max_new_tokens=8,
                                              do_sample=False))
    if kind != "minimax":  # its first layer keeps no keys: its length reads 0
        assert int(reference.get_seq_length()) == 6 + 8 - 1  # the last token is not fed back
    for fail_at in (None, 0, 3):
        cache = new_cache()
        got = _own_decode_loop(model, ids, mask, cache, 8, fail_at)
        assert torch.equal(got, expected), fail_at
        assert int(cache.get_seq_length()) == int(reference.get_seq_length())
        _assert_same_cache_states(cache, reference)


@pytest.mark.timeout(120)
def test_the_generate_graph_script_runs_its_eager_loop_on_cpu() -> None:
    """On CPU the script checks its own decode loop (eager DBO) against generate; on CUDA
    (tests/gpu/test_generate_graph.py) the decode steps are graph replays."""
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "generate_graph.py"), "--rows", "4",
         "--new-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["captured"] is False
    assert result["tokens_equal"] is True and result["eager_loop_equal"] is True


def test_beam_search_reorders_the_cache_between_steps_and_stays_token_identical() -> None:
    """Beam search reorders the caller's cache outside the overlap (new tensors): the next
    step's split starts from the reordered cache."""
    for kind, cache in (("qwen2_moe", "dynamic"), ("qwen2_moe", "static"),
                        ("mistral", "dynamic"), ("mamba", "dynamic")):
        model = tiny_model(kind)
        ids, mask = prompts(4, 6, seed=1)
        expected, got = both(model, ids, mask, ALWAYS, max_new_tokens=6, num_beams=2,
                             do_sample=False, cache_implementation=cache)
        assert torch.equal(got, expected), (kind, cache)


@pytest.fixture
def eager_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dbo.capture_graph` on CPU: the captured run just runs (`_EagerCapture`)."""
    monkeypatch.setattr(dbo.graphs, "_Capture", _EagerCapture)
    monkeypatch.setattr(dbo.graphs, "_cuda_device", lambda inputs: torch.device("cpu"))


def _logits_step(model: torch.nn.Module) -> Any:
    """A decode step of one's own: the logits of `model` on `tokens`, with `cache`."""

    def step(tokens: torch.Tensor, attention_mask: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(tokens, attention_mask=attention_mask, cache=cache, use_cache=True).logits

    return step


class _EagerCapture:
    """Stands in for `dbo.graphs._Capture` on CPU: the captured run just runs."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device, self.graph = device, self

    def current_stream(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    capturing = current_stream


def test_a_static_cache_in_capture_graph_advances_once_per_run_warmups_included(
    eager_capture: None,
) -> None:
    """capture_graph splits once and runs the same parts warmup + 1 times: every run
    (the captured one too, whose advance a replay repeats) adds its token to the length."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model("qwen3_moe")
    ids, mask = prompts(4, 6, seed=3)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    full = torch.cat([mask, torch.ones(4, 10, dtype=mask.dtype)], dim=1)
    step = _logits_step(model)

    with torch.no_grad():
        dbo.overlap(step, timeout_s=30)(ids, full[:, :6], cache)
        assert int(cache.get_seq_length()) == 6
        dbo.capture_graph(step, ids[:, -1:], full, cache, warmup=2)
    assert int(cache.get_seq_length()) == 6 + 3


def test_linear_attention_states_in_capture_graph_advance_once_per_run_in_place(
    eager_capture: None,
) -> None:
    """Mamba's states are written in place (a replay repeats the writes): after the
    warmups and the captured run, the caller's states are those of three steps."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model("mamba")
    ids, mask = prompts(4, 6, seed=3)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    step = _logits_step(model)
    with torch.no_grad():
        dbo.overlap(step, timeout_s=30)(ids, mask, caches[0])
        storages = [layer.recurrent_states[0].data_ptr() for layer in caches[0].layers]
        dbo.capture_graph(step, ids[:, -1:], mask, caches[0], warmup=2)
        step(ids, mask, caches[1])
        for _ in range(3):
            step(ids[:, -1:], mask, caches[1])
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(mine.conv_states[0], theirs.conv_states[0])
        torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0])
    assert [layer.recurrent_states[0].data_ptr() for layer in caches[0].layers] == storages


def test_a_cache_whose_windows_or_states_a_failed_call_overwrote_is_refused_not_reused(
) -> None:
    """A StaticCache's sliding windows are written in place, and once full a write rolls
    them; linear-attention states are overwritten by every call. A call that fails before
    overwriting leaves the cache as before (the step can run again); one that overwrote
    leaves windows or states that no longer match the tokens: the next call is refused
    instead of generating from them."""
    transformers = pytest.importorskip("transformers")
    refused = "written in place by an overlapped call that failed"
    model = tiny_model("mistral")
    ids, mask = prompts(5, WINDOW - 1, seed=4)  # the prefill leaves the windows not full
    expected = generate(model, ids, mask, max_new_tokens=8, do_sample=False)
    for fail_at in (None, 0, 1):  # step 1 writes the window's last free position
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        assert type(cache.layers[0]).__name__ == "StaticSlidingWindowLayer"
        got = _own_decode_loop(model, ids, mask, cache, 8, fail_at)
        assert torch.equal(got, expected), fail_at
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match=refused):
        _own_decode_loop(model, ids, mask, cache, 8, fail_at=2)  # step 2 rolls the windows
    model = tiny_model("mamba")
    expected = generate(model, ids, mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(_own_decode_loop(model, ids, mask, transformers.DynamicCache(
        config=model.config), 8), expected)
    with pytest.raises(ValueError, match=refused):
        _own_decode_loop(model, ids, mask, transformers.DynamicCache(config=model.config), 8,
                         fail_at=0)


@pytest.mark.parametrize(("kind", "cache_kind", "message"), [
    ("qwen3_moe", "dynamic", "DynamicCache.*capture_graph.*StaticCache"),
    ("mistral", "dynamic", "DynamicCache.*capture_graph.*StaticCache"),  # sliding windows
    ("mistral", "static", "sliding-window layers cannot be in a dbo.capture_graph"),
])
def test_a_cache_a_replay_cannot_advance_is_refused_in_capture_graph_before_the_capture(
    eager_capture: None, kind: str, cache_kind: str, message: str,
) -> None:
    """A DynamicCache's lengths and views live in Python, which a replay does not run (every
    replay would write its token at the same position); a StaticCache's sliding windows
    keep their fill state and mask offsets in Python ints. Refused in the first warmup
    run, before anything is captured; the cache is as before."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model(kind)
    ids, mask = prompts(4, 6, seed=3)
    if cache_kind == "static":
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    else:
        cache = transformers.DynamicCache(config=model.config)
    step = _logits_step(model)
    with torch.no_grad():
        dbo.overlap(step, timeout_s=30)(ids, mask, cache)
        with pytest.raises(ValueError, match=message):
            dbo.capture_graph(step, ids[:, -1:], torch.cat([mask, mask[:, :1]], dim=1), cache)
    assert int(cache.get_seq_length()) == 6


@pytest.mark.parametrize(
    "kind", ["nemotron_h", "falcon_h1", "deepseek_v32", "gpt_oss", "deepseek_v4", "minimax"]
)
def test_caches_the_ubatches_make_of_every_kind_of_layer_are_joined_by_rows(kind: str) -> None:
    """A forward called without a cache: each ubatch makes its own (Nemotron-H: Mamba
    states, attention keys, layers holding nothing; Falcon-H1: both in one layer;
    DeepSeek-V3.2: indexer keys; GPT-OSS: windows; DeepSeek-V4: windows and compressor
    states; MiniMax: states in a cache class of its own), joined into one of every row, as
    the whole batch's forward makes it."""
    model = tiny_model(kind)
    ids, mask = prompts(4, WINDOW + 2, seed=5)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=True).cache
        joined = dbo.overlap(model, timeout_s=30)(ids, attention_mask=mask, use_cache=True).cache
    assert [type(layer) for layer in joined.layers] == [type(layer) for layer in whole.layers]
    assert type(joined) is type(whole)
    _assert_same_cache_states(joined, whole)
    for mine, theirs in zip(joined.layers, whole.layers):
        mine, theirs = _layer_state(mine), _layer_state(theirs)
        assert mine.keys() == theirs.keys(), kind
        for name, value in theirs.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(mine[name], value, msg=name)
            else:
                assert mine[name] == value, name
