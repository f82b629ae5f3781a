"""The ops `comm` records under `torch.compile` (`comm.compiled`, `comm.moe.compiled`):
what the compiler relies on, in a world of one, where each exchange is the identity and
so is its gradient: the schema, the fake kernel's shapes, the autograd registration."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

_ALL_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("op, args, checks", [
    ("all_reduce", lambda group: (torch.randn(3), "SUM", group), _ALL_OPCHECKS[:3]),
    ("all_to_all_single", lambda group: (torch.empty(4), torch.randn(4), None, None, group),
     _ALL_OPCHECKS[:3]),
    ("moe_exchange_rows", lambda group: (torch.randn(6, 3, requires_grad=True), group, True),
     _ALL_OPCHECKS),
    # opcheck's AOT check sums every output into one, which an int64 first output breaks.
    ("moe_dispatch_exchange", lambda group: (
        torch.tensor([[2, 1, 0]]), torch.randn(6, 3, requires_grad=True), group, True, 2, True),
     _ALL_OPCHECKS[:3]),
    ("moe_dispatch_rows", lambda group: (
        torch.tensor([[2, 1]]), torch.tensor(False), torch.randn(3, 4, requires_grad=True),
        group, 2, True), _ALL_OPCHECKS),
    ("moe_split_rows", lambda group: (
        torch.randn(3, 4, requires_grad=True), torch.tensor([[2, 1, 3]]), True, 3, group, True),
     _ALL_OPCHECKS),
])
def test_each_compiled_exchange_is_an_op_with_a_fake_kernel_and_its_gradient(
    world_of_one: None, op: str, args: Any, checks: tuple[str, ...]
) -> None:
    group = dist.group.WORLD.group_name
    torch.library.opcheck(getattr(torch.ops.dbo_comm, op), args(group), test_utils=checks)
