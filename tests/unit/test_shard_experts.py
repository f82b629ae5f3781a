"""`comm.moe.shard_experts` on tiny random Hugging Face MoE models, in a world of one rank.

The sharded model equals the unsharded one (outputs and gradients, allclose), overlapped
it equals the serial run of the same ubatch split (bitwise), and its outputs merge
through the default merge. Two ranks: tests/distributed/test_hf_moe.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import comm
import dbo

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from hf_moe import build_model  # noqa: E402 - the example's builder

TIMEOUT_S = 30.0
VOCAB = 64


def tiny_moe(kind: str, num_experts: int = 4) -> torch.nn.Module:
    """A 2-layer random-weight MoE causal LM of the family `kind` (no hub access)."""
    return build_model(kind, layers=2, hidden=32, experts=num_experts, topk=2, vocab=VOCAB)


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sharded_model_equals_the_unsharded_one_with_its_gradients(
    kind: str, world_of_one: None
) -> None:
    model = tiny_moe(kind)
    reference = copy.deepcopy(model)
    names = comm.moe.shard_experts(model)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    _assert_same_outputs_and_gradients(model, reference, ids)


def _assert_same_outputs_and_gradients(
    model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor
) -> None:
    got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected)
    (got * got).sum().backward()
    (expected * expected).sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if grads[name].grad is None:  # not trained through the loss (AfMoE's expert bias)
            assert param.grad is None, name
        else:
            torch.testing.assert_close(param.grad, grads[name].grad, msg=name)


@pytest.mark.parametrize(
    ("kind", "experts_implementation"),
    [("mixtral", "eager"), ("qwen2_moe", "batched_mm"), ("qwen3_moe", "eager")],
)
def test_on_the_fixed_shape_path_a_sharded_model_equals_the_unsharded_one(
    kind: str, experts_implementation: str, world_of_one: None
) -> None:
    model = tiny_moe(kind)
    model.set_experts_implementation(experts_implementation)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    comm.moe.shard_experts(model, capacity=ids.numel())  # >= T: nothing dropped
    _assert_same_outputs_and_gradients(model, reference, ids)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        comm.moe.shard_experts(tiny_moe(kind), capacity=0)


def test_a_deep_copy_of_a_sharded_model_routes_through_its_own_experts(
    world_of_one: None,
) -> None:
    model = tiny_moe("mixtral")
    comm.moe.shard_experts(model)
    twin = copy.deepcopy(model)  # the process group is shared, not copied
    experts = twin.model.layers[0].mlp.experts
    assert experts.forward.__self__ is experts
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
        experts.down_proj.zero_()
        assert not torch.equal(twin(ids).logits, model(ids).logits)


def test_qwen2_moe_still_applies_its_gated_shared_expert(world_of_one: None) -> None:
    model = tiny_moe("qwen2_moe")
    comm.moe.shard_experts(model)
    block = model.model.layers[0].mlp
    hidden = torch.randn(2, 5, 32)
    with torch.no_grad():
        with_shared = block(hidden)
        block.shared_expert_gate.weight.fill_(-1e4)  # sigmoid -> 0: the shared expert off
        without = block(hidden)
    assert not torch.allclose(with_shared, without)


@pytest.mark.parametrize("kind", KINDS)
def test_an_overlapped_sharded_model_equals_its_serial_ubatches_and_merges_its_output(
    kind: str, world_of_one: None
) -> None:
    model = tiny_moe(kind)
    comm.moe.shard_experts(model)
    step = dbo.overlap(model, no_split=["position_ids"], timeout_s=TIMEOUT_S)
    hooks = dbo.yield_between(model.model.layers)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(6).unsqueeze(0)  # [1, S]: the same for every row
    with torch.no_grad():
        out = step(ids, position_ids=positions)
        serial = [model(part, position_ids=positions) for part in ids.tensor_split(2)]
    hooks.remove()
    assert type(out).__name__ == "MoeCausalLMOutputWithPast"
    assert torch.equal(out.logits, torch.cat([part.logits for part in serial]))


def _nested_router_model(kind: str) -> torch.nn.Module:
    """AfMoE (router weight at `router.gate`) or HunYuan-MoE (at `gate.wg`), 2 layers, 4
    experts top-2."""
    import transformers

    dense = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    if kind == "afmoe":
        config = transformers.AfmoeConfig(num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, num_dense_layers=0,
                                          num_shared_experts=1, **dense)
        return transformers.AfmoeForCausalLM(config)
    config = transformers.HunYuanMoEV1Config(num_experts=4, moe_topk=2, **dense)
    return transformers.HunYuanMoEV1ForCausalLM(config)


@pytest.mark.parametrize("kind", ["afmoe", "hunyuan_v1_moe"])
def test_a_block_whose_router_weight_sits_deeper_is_sharded_and_equals_the_unsharded_one(
    kind: str, world_of_one: None
) -> None:
    model = _nested_router_model(kind)
    reference = copy.deepcopy(model)
    assert comm.moe.shard_experts(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    _assert_same_outputs_and_gradients(model, reference, ids)


def test_a_model_without_a_sparse_moe_block_is_refused_naming_its_class(
    world_of_one: None,
) -> None:
    with pytest.raises(ValueError, match="no sparse MoE block in Sequential"):
        comm.moe.shard_experts(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = tiny_moe("qwen3_moe")
    comm.moe.shard_experts(model)
    with pytest.raises(ValueError, match="no sparse MoE block in Qwen3MoeForCausalLM"):
        comm.moe.shard_experts(model)  # sharded already


def test_an_expert_count_the_group_does_not_divide_is_refused_before_any_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class GroupOfThree:
        def size(self) -> int:
            return 3

    monkeypatch.setattr("comm.moe.hf.resolve_group", lambda group: GroupOfThree())
    model = tiny_moe("mixtral", num_experts=4)
    before = {name: param.shape for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match="4 experts, which do not split evenly over the 3"):
        comm.moe.shard_experts(model)
    assert {name: param.shape for name, param in model.named_parameters()} == before


def test_a_block_whose_experts_take_weighted_tokens_is_refused_before_any_change(
    world_of_one: None,
) -> None:
    """Llama 4's block weights every token for every expert before its experts module,
    which takes only those rows: nothing to route by. Refused when sharding, not at the
    first forward."""
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=1,
    )
    model = transformers.Llama4ForCausalLM(config).eval()
    before = {name: param.shape for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.feed_forward\.experts "
                                         r"\(Llama4TextExperts\).*top_k_index"):
        comm.moe.shard_experts(model)
    assert {name: param.shape for name, param in model.named_parameters()} == before


def test_a_loss_stops_the_merge_and_a_cache_made_in_the_ubatches_is_joined(
    world_of_one: None,
) -> None:
    model = tiny_moe("qwen3_moe")
    comm.moe.shard_experts(model)
    step = dbo.overlap(model, timeout_s=TIMEOUT_S)
    ids = torch.randint(0, VOCAB, (4, 6))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"output\['loss'\].*compute it again from the"):
            step(ids, labels=ids)
        with pytest.raises(ValueError, match=r"aux_loss.*weight each ubatch's by its rows"):
            step(ids, output_router_logits=True)
        joined = step(ids, use_cache=True).cache  # each ubatch made its own: one copy joins them
        whole = model(ids, use_cache=True).cache
    assert joined.get_seq_length() == 6 and joined.layers[0].keys.shape[0] == 4
    for mine, theirs in zip(joined.layers, whole.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


def test_training_through_an_overlapped_sharded_model_gives_the_serial_gradients(
    world_of_one: None,
) -> None:
    model = tiny_moe("qwen2_moe").train()
    comm.moe.shard_experts(model)
    twin = copy.deepcopy(model)
    step = dbo.overlap(model, no_split=["position_ids"], timeout_s=TIMEOUT_S)
    dbo.yield_between(model.model.layers)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6).unsqueeze(0)
    out = step(ids, position_ids=positions).logits
    (out * out).sum().backward()  # one loss on the merged output
    serial = torch.cat([twin(part, position_ids=positions).logits for part in ids.tensor_split(2)])
    (serial * serial).sum().backward()
    assert torch.equal(out, serial)
    grads = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, grads[name].grad), name
