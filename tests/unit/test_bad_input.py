"""Bad input across dbo, workspace and comm: one table, one row per mistake a user makes.

Each row makes one bad call and checks three things: the error type; a message that
names the argument (its parameter name or its place, `args[1]`, `request 0`) and says
what to do or which values are valid; and that nothing changed, by a valid call on the
same object (runner, workspace manager, overlapped wrapper, process group) that must
work right after. A row marked xfail is a message that does not meet this yet; its
reason gives the message it should have.

The table is the index; the deeper tests of each area live in:
    dbo.overlap options and calls     test_overlap.py, test_overlap_edge_cases.py,
                                      test_no_split_and_yield_between.py
    split, merge, balanced_token_split test_split.py, test_overlap_containers.py
    UBatchRunner and calls in a ubatch test_ubatch_api.py, test_runner_close.py,
                                      test_runner_failures.py, test_recv_hooks.py
    workspace                         test_workspace.py
    collectives                       test_comm_checks.py, test_comm_collectives.py
    comm.moe                          test_comm_moe.py
    init_distributed, ubatch_groups   test_comm_init.py, test_comm_groups.py
    EmulatedLink, Trace               test_emulated_link.py, test_tracing.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

import comm
import dbo
import workspace
from dbo import RunnerState, UBatchRunner

X = torch.arange(8.0).reshape(4, 2)
WARM = ((256,), torch.float32)  # 1 KiB: the capacity of the `manager` fixture


class Case(NamedTuple):
    bad: Callable[[Any], object]  # the bad call, given the fixture's value
    error: type[BaseException]
    match: str  # regex: names the argument and says what to do
    then: Callable[[Any], bool]  # a valid call on the same object; True when it works
    given: str | None = None  # the fixture both calls get (None: nothing)


def row(name: str, *case: Any, xfail: str | None = None, **options: Any) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(Case(*case, **options), id=name, marks=marks)


# ----------------------------------------------------------------- what the rows call


def _double(x: torch.Tensor, *extra: Any, loss: bool = False) -> torch.Tensor:
    """The overlapped function: `extra` carries bad arguments; `loss` returns 0-dim."""
    return x.sum() if loss else x * 2


def _parts() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return dbo.default_split((X,), {}, 2)


def _doubles(wrapper: Callable[..., torch.Tensor]) -> bool:
    return torch.equal(wrapper(X), X * 2)


def _overlap_works(_: object = None) -> bool:
    return _doubles(dbo.overlap(_double))


def _runs(runner: UBatchRunner) -> bool:
    outputs = runner.run(_double, _parts())
    return runner.state is RunnerState.IDLE and torch.equal(torch.cat(outputs), X * 2)


def _run_after_close(runner: UBatchRunner) -> object:
    runner.close()
    return runner.run(_double, _parts())


def _still_closed(runner: UBatchRunner) -> bool:
    runner.close()  # idempotent
    return runner.state is RunnerState.CLOSED


def _switch_to_comm_twice(x: torch.Tensor) -> torch.Tensor:
    dbo.switch_to_comm()
    dbo.switch_to_comm()
    return x


def _traced_one_call(_: object) -> bool:
    with dbo.trace(max_spans=1) as timeline:  # no half-started trace is left recording
        _overlap_works()
    return len(timeline.spans) == 1 and timeline.dropped > 0


def _splits_tokens(_: object) -> bool:
    first, second = dbo.balanced_token_split([3, 1], 2)
    return first.token_slice == slice(0, 2) and second.token_slice == slice(2, 4)


@dataclasses.dataclass
class Batch:  # not registered with torch.utils._pytree
    ids: torch.Tensor


def _use_workspace(x: torch.Tensor) -> torch.Tensor:
    workspace.current_workspace_manager().get_simultaneous(WARM)
    return x * 2


def _lock_workspace_inside(x: torch.Tensor) -> torch.Tensor:
    workspace.lock_workspace()
    return x


def _grow_after_lock(manager: workspace.WorkspaceManager) -> object:
    manager.lock()
    return manager.get_simultaneous(((1024,), torch.float32))


def _unchanged(manager: workspace.WorkspaceManager) -> bool:
    """The warm request still served from the 1 KiB slots, which never grew again."""
    view = manager.get_simultaneous(WARM)[0]
    stats = manager.stats()
    return view.shape == (256,) and (stats.capacity_bytes, stats.num_resizes) == (1024, 1)


def _lock_outside(manager: workspace.WorkspaceManager) -> bool:
    workspace.lock_workspace()
    return manager.is_locked() and _unchanged(manager)


def _same_manager(manager: workspace.WorkspaceManager) -> bool:
    again = workspace.init_workspace_manager("cpu", 2)
    return again is manager and workspace.current_workspace_manager() is manager


def _all_to_all(output_splits: Any, input_splits: Any, source: Any = X) -> torch.Tensor:
    output = torch.empty_like(X)
    comm.all_to_all_single(output, source, output_splits, input_splits)
    return output


def _all_to_all_works(_: object) -> bool:
    return torch.equal(_all_to_all([4], [4]), X) and torch.equal(_all_to_all(None, None), X)


def _all_reduce_works(_: object) -> bool:
    tensor = X.clone()
    comm.all_reduce(tensor)
    return torch.equal(tensor, X)  # a world of one


def _dispatch(topk_ids: Any, num_experts: Any = 4) -> Any:
    return comm.moe.dispatch(X, topk_ids, num_experts)


def _dispatch_and_combine(_: object) -> bool:
    recv_x, _, handle = _dispatch(torch.tensor([[3], [0], [2], [1]]))
    return torch.equal(comm.moe.combine(recv_x, handle, torch.ones(4, 1)), X)


def _same_world(_: object) -> bool:
    return comm.init_distributed(allow_single_process=True) == (0, 1, torch.device("cpu"))


def _init_inside(x: torch.Tensor) -> torch.Tensor:
    comm.init_distributed(allow_single_process=True)
    return x


def _link_delivers(link: comm.EmulatedLink | None) -> bool:
    link = link or comm.EmulatedLink(0.0)
    return link.transfer(X).wait() is X


# ----------------------------------------------------------------------- fixtures


@pytest.fixture
def overlapped() -> Callable[..., torch.Tensor]:
    return dbo.overlap(_double)


@pytest.fixture
def runner() -> Iterator[UBatchRunner]:
    with UBatchRunner(2) as runner:
        yield runner


@pytest.fixture
def manager(fresh_workspace_global: None) -> workspace.WorkspaceManager:
    """The process-wide 2-slot CPU manager, warmed to 1 KiB per slot."""
    manager = workspace.init_workspace_manager("cpu", 2)
    manager.get_simultaneous(WARM)
    return manager


@pytest.fixture
def link() -> comm.EmulatedLink:
    return comm.EmulatedLink(0.001)


# -------------------------------------------------------------------------- the table

CASES = [
    # dbo.overlap's options
    row("overlap-num_ubatches-0", lambda _: dbo.overlap(_double, num_ubatches=0), ValueError,
        r"num_ubatches must be in \[1, 1024\], got 0", _overlap_works),
    row("overlap-num_ubatches-str", lambda _: dbo.overlap(_double, num_ubatches="2"), TypeError,
        r"num_ubatches must be an int >= 1, got '2'", _overlap_works),
    row("overlap-timeout_s-negative", lambda _: dbo.overlap(_double, timeout_s=-1), ValueError,
        r"timeout_s must be > 0, got -1", _overlap_works),
    row("overlap-timeout_s-str", lambda _: dbo.overlap(_double, timeout_s="5"), TypeError,
        r"timeout_s must be a number of seconds or None, got '5'", _overlap_works),
    row("overlap-min_batch_size-0", lambda _: dbo.overlap(_double, min_batch_size=0), ValueError,
        r"min_batch_size must be >= 1 \(an int, or None", _overlap_works),
    row("overlap-split-not-callable", lambda _: dbo.overlap(_double, split=3), TypeError,
        r"split must be callable, got 3", _overlap_works),
    row("overlap-no_split-missing-parameter", lambda _: dbo.overlap(_double, no_split="mask"),
        ValueError, r"no_split names 'mask', which is not a named parameter of _double "
        r"\(those are x, loss\); .* wrap it in a function that names it", _overlap_works),
    row("overlap-no_split-and-split", lambda _: dbo.overlap(_double, no_split=1, split=print),
        ValueError, r"pass no_split= or split=, not both", _overlap_works),
    row("overlap-split-returns-one-part",
        lambda _: dbo.overlap(_double, split=lambda a, k, n: [(a, k)])(X), ValueError,
        r"split\(args, kwargs, num_ubatches\) must hold one \(args_tuple, kwargs_dict\) pair "
        r"per ubatch: num_ubatches=2, got 1", _overlap_works),
    # unsplittable inputs and unmergeable outputs, on one wrapper
    row("overlap-dim0-sizes-differ", lambda w: w(X, torch.ones(3)), ValueError,
        r"dim-0 sizes differ \(args\[0\]: 4, args\[1\]: 3\); pass no_split=", _doubles,
        given="overlapped"),
    row("overlap-unregistered-dataclass", lambda w: w(X, Batch(torch.ones(4))), ValueError,
        r"cannot split args\[1\]: .*register_dataclass\(Batch\), or pass split=", _doubles,
        given="overlapped"),
    row("default_merge-0-dim-outputs", lambda w: w(X, loss=True), ValueError,
        r"cannot merge output: it is a 0-dim tensor .* pass merge=", _doubles,
        given="overlapped"),
    # balanced_token_split
    row("token_split-negative-count", lambda _: dbo.balanced_token_split([3, -1], 2),
        ValueError, r"num_tokens_per_request must .*>= 0, got \[3, -1\]", _splits_tokens),
    row("token_split-float-count", lambda _: dbo.balanced_token_split([1.5, 2], 2), TypeError,
        r"num_tokens_per_request must hold integer counts, got 1.5", _splits_tokens),
    row("token_split-2d-tensor",
        lambda _: dbo.balanced_token_split(torch.ones(2, 2, dtype=torch.long), 2), ValueError,
        r"num_tokens_per_request must be 1-D, got shape \(2, 2\)", _splits_tokens),
    # UBatchRunner: arguments, use after close(), calls from its own ubatches
    row("runner-wrong-input-count", lambda r: r.run(_double, _parts()[:1]), ValueError,
        r"ubatch_inputs .*one \(args_tuple, kwargs_dict\) pair per ubatch", _runs,
        given="runner"),
    row("runner-input-not-a-pair", lambda r: r.run(_double, [((X,), {}), [X]]), TypeError,
        r"ubatch_inputs\[1\] must be an \(args_tuple, kwargs_dict\) pair, got a list", _runs,
        given="runner"),
    row("runner-timeout_s-0", lambda r: r.run(_double, _parts(), timeout_s=0), ValueError,
        r"timeout_s must be > 0, got 0", _runs, given="runner"),
    row("runner-run-after-close", _run_after_close, RuntimeError,
        r"this UBatchRunner is closed; create a new one", _still_closed, given="runner"),
    row("runner-run-from-own-ubatch",
        lambda r: r.run(lambda x: r.run(_double, _parts()), _parts()), RuntimeError,
        r"UBatchRunner.run was called from a ubatch thread of one of its own runs, which would "
        r"wait for itself; a nested overlap runs inline \(dbo.overlap", _runs, given="runner"),
    row("runner-close-from-own-ubatch", lambda r: r.run(lambda x: r.close(), _parts()),
        RuntimeError, r"UBatchRunner.close was called from a ubatch thread .*would wait for "
        "itself", _runs, given="runner"),
    row("switch_to_comm-twice", lambda r: r.run(_switch_to_comm_twice, _parts()), RuntimeError,
        r"ubatch 0 is already on its comm stream; each switch_to_comm\(\) must be matched by "
        r"one switch_to_compute\(\)", _runs, given="runner"),
    row("register_recv_hook-not-callable",
        lambda r: r.run(dbo.register_recv_hook, [((3,), {})] * 2), TypeError,
        r"hook must be callable, got 3", _runs, given="runner"),
    # dbo.trace
    row("trace-max_spans-0", lambda _: dbo.trace(max_spans=0).__enter__(), ValueError,
        r"max_spans must be an int >= 1, got 0", _traced_one_call),
    row("trace-max_spans-float", lambda _: dbo.Trace(max_spans=1.5), TypeError,
        r"max_spans must be an int >= 1, got 1.5", _traced_one_call),
    # workspace: growth after lock, calls in the wrong phase, bad requests
    row("workspace-grow-after-lock", _grow_after_lock, workspace.WorkspaceLockedError,
        r"needs 4096 B per slot and the locked capacity is 1024 B; warm up with the largest "
        r"batch before lock_workspace\(\), or call unlock_workspace\(\)",
        lambda m: _unchanged(m) and m.is_locked(), given="manager"),
    row("workspace-lock-inside-overlap", lambda m: dbo.overlap(_lock_workspace_inside)(X),
        RuntimeError, r"lock\(\) was called inside an overlap; .* Lock outside dbo.overlap",
        _lock_outside, given="manager"),
    row("workspace-negative-dimension", lambda m: m.get_simultaneous(((-1, 4), torch.int8)),
        ValueError, r"workspace request 0: shape \(-1, 4\) has a negative dimension",
        _unchanged, given="manager"),
    row("workspace-dtype-not-a-dtype", lambda m: m.get_simultaneous(((4,), "float32")),
        TypeError, r"workspace request 0: dtype must be a torch.dtype, got 'float32'",
        _unchanged, given="manager"),
    row("workspace-too-few-slots", lambda m: dbo.overlap(_use_workspace, num_ubatches=3)(X),
        RuntimeError, r"ubatch 2 asked for workspace, but the manager has 2 slot\(s\); create "
        r"it with num_ubatches >= 3", lambda m: _doubles(dbo.overlap(_use_workspace)) and
        _unchanged(m), given="manager"),
    row("workspace-init-other-slot-count", lambda m: workspace.init_workspace_manager("cpu", 4),
        RuntimeError, r"already exists .*; call reset_workspace_manager\(\) before initializing "
        r"one with device=cpu, num_ubatches=4", _same_manager, given="manager"),
    row("workspace-not-initialized", lambda _: workspace.current_workspace_manager(),
        RuntimeError, r"call workspace.init_workspace_manager\(device, num_ubatches\) first",
        lambda _: workspace.init_workspace_manager("cpu", 2) is
        workspace.current_workspace_manager(), given="fresh_workspace_global"),
    # comm collectives on a world of one
    row("all_to_all-splits-do-not-sum", lambda _: _all_to_all([4], [3]), ValueError,
        r"input_split_sizes \[3\] sums to 3, but input has 4 rows \(dim 0\); the sizes must "
        r"add up to input.shape\[0\]", _all_to_all_works, given="world_of_one"),
    row("all_to_all-one-split-per-rank", lambda _: _all_to_all([2, 2], [2, 2]), ValueError,
        r"output_split_sizes must have one entry per rank of the group \(1\), got 2",
        _all_to_all_works, given="world_of_one"),
    row("all_to_all-dtypes-differ", lambda _: _all_to_all(None, None, X.long()), TypeError,
        r"output and input must have the same dtype, got torch.float32 and torch.int64; "
        r"convert one with .to\(torch.float32\)", _all_to_all_works, given="world_of_one"),
    row("all_reduce-op-not-a-ReduceOp", lambda _: comm.all_reduce(X.clone(), op="sum"),
        TypeError, r"op must be a torch.distributed.ReduceOp, got 'sum'", _all_reduce_works,
        given="world_of_one"),
    # comm.moe.dispatch
    row("dispatch-expert-id-out-of-range", lambda _: _dispatch(torch.tensor([[0], [7], [1], [2]])),
        ValueError, r"topk_ids must be in \[0, num_experts\) = \[0, 4\); the group's rank\(s\) "
        r"\[0\] passed expert ids outside it", _dispatch_and_combine, given="world_of_one"),
    row("dispatch-float-expert-ids", lambda _: _dispatch(torch.zeros(4, 1)), TypeError,
        r"topk_ids must be an integer tensor \(torch.int64\), got torch.float32",
        _dispatch_and_combine, given="world_of_one"),
    row("dispatch-num_experts-0", lambda _: _dispatch(torch.zeros(4, 1, dtype=torch.long), 0),
        ValueError, r"num_experts must be an int >= 1, got 0", _dispatch_and_combine,
        given="world_of_one"),
    # comm.init_distributed and comm.ubatch_groups
    row("init_distributed-timeout_s-negative", lambda _: comm.init_distributed(timeout_s=-1),
        ValueError, r"timeout_s must be a number of seconds in \(0, 1e\+08\], got -1",
        _same_world, given="world_of_one"),
    row("init_distributed-backend-not-str", lambda _: comm.init_distributed(backend=3),
        TypeError, r"backend must be a string such as 'nccl' or 'gloo', got 3", _same_world,
        given="world_of_one"),
    row("init_distributed-num_ubatch_groups-negative",
        lambda _: comm.init_distributed(num_ubatch_groups=-1), ValueError,
        r"num_ubatch_groups must be in \[0, 1024\], got -1", _same_world, given="world_of_one"),
    row("init_distributed-other-backend", lambda _: comm.init_distributed(backend="nccl"),
        ValueError, r"already initialized with backend 'gloo'; call "
        r"comm.destroy_distributed\(\) on every rank first", _same_world, given="world_of_one"),
    row("init_distributed-inside-overlap", lambda _: dbo.overlap(_init_inside)(X), RuntimeError,
        r"init_distributed\(\) was called inside dbo.overlap; initialize once per process "
        "before overlapping", _all_reduce_works, given="world_of_one"),
    row("ubatch_groups-num_ubatches-0", lambda _: comm.ubatch_groups(None, 0), ValueError,
        r"num_ubatches must be in \[1, 1024\], got 0", _all_reduce_works, given="world_of_one"),
    # comm.EmulatedLink
    row("link-latency-negative", lambda _: comm.EmulatedLink(-1), ValueError,
        r"latency_s must be a finite number >= 0, got -1", _link_delivers),
    row("link-bandwidth-0", lambda _: comm.EmulatedLink(0, bandwidth_bytes_per_s=0),
        ValueError, r"bandwidth_bytes_per_s must be > 0, got 0", _link_delivers),
    row("link-transfer-not-a-tensor", lambda link: link.transfer([1.0, 2.0]), TypeError,
        r"transfer needs a tensor, got list", _link_delivers, given="link"),
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_a_helpful_error_and_changes_nothing(
    case: Case, request: pytest.FixtureRequest
) -> None:
    given = request.getfixturevalue(case.given) if case.given else None
    with pytest.raises(case.error, match=case.match):
        case.bad(given)
    assert case.then(given) is True



def test_a_module_sharded_by_fsdp1_is_refused_naming_fully_shard() -> None:
    """FullyShardedDataParallel (FSDP1) needs an accelerator to build: a stand-in of its
    class, as `isinstance` sees it."""
    from torch.distributed import fsdp

    class Sharded(fsdp.FullyShardedDataParallel):
        def __init__(self, module: torch.nn.Module) -> None:
            torch.nn.Module.__init__(self)
            self._fsdp_wrapped_module = module

    model = torch.nn.Sequential(Sharded(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"Linear.*FullyShardedDataParallel.*fully_shard"):
        dbo.overlap(model)
    with pytest.raises(ValueError, match="FSDP1"):
        dbo.overlap(model.forward)
