"""`dbo.capture_graph`: both ubatches of one overlapped call in one CUDA graph, replayed
with one launch and no threads (a decode step's launches can take longer than its kernels).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves

from dbo._checks import check_num_ubatches
from dbo._torch_private import private
from dbo.device.cuda import CudaBackend
from dbo.overlap import Overlapped
from dbo.runtime.context import current_context
from dbo.runtime.pool import runner_pool
from dbo.split.batch import UBatchInputs, batch_size_of, split_parts, splittable_leaves
from dbo.split.outputs import default_merge
from dbo.ubatch import IN_CAPTURE, run_state

CAPTURE_ERROR_MODE = "global"
"""The capture's `cudaStreamCaptureMode`. A kernel any thread launches onto a stream that
joined the capture is captured in every mode; a mode only says which threads are barred
from capture-unsafe calls (a cudaMalloc, a synchronizing copy). "global" also bars the
ubatch threads, which launch `fn`'s work, so an unsafe call there fails the capture
("thread_local" would watch only this thread, which waits for the baton); torch's
allocator relaxes it around its own cudaMalloc. No other thread may make such calls
meanwhile."""

class OverlapGraph:
    """An overlapped call captured by `dbo.capture_graph`; replays with no threads.

    `outputs` are the static output tensors, rewritten by every replay (clone what must
    outlive the next one); `static_inputs` are what the next replay reads; `cuda_graph`
    is the `torch.cuda.CUDAGraph`. The graph holds the addresses of both and of the
    workspace buffers: keep the workspace manager, locked, while you replay (capture the
    largest batch first), and order the replays with its other users (one stream does).
    """

    def __init__(self, cuda_graph: Any, static_inputs: tuple[Any, ...], outputs: Any) -> None:
        self.cuda_graph = cuda_graph
        self.static_inputs = static_inputs
        self.outputs = outputs
        self._leaves, self._spec = tree_flatten(static_inputs)

    def replay(self) -> None:
        """Launch the graph on the current stream: every ubatch's kernels on its compute
        and comm branches, then the merge. No host work beyond the launch."""
        self.cuda_graph.replay()

    def __call__(self, *inputs: Any) -> Any:
        """Copy `inputs` into `static_inputs` on the current stream, replay, return
        `outputs`. ValueError, before any copy, unless `inputs` has their structure,
        tensors of their shapes and equal non-tensor leaves."""
        leaves, spec = tree_flatten(inputs)
        if spec != self._spec:
            raise ValueError(f"inputs must be structured like the static inputs: {self._spec}")
        for index, (static, new) in enumerate(zip(self._leaves, leaves)):
            if isinstance(static, torch.Tensor):
                same = isinstance(new, torch.Tensor) and new.shape == static.shape
            else:
                same = not isinstance(new, torch.Tensor) and new == static
            if not same:
                raise ValueError(
                    f"input leaf {index} is {_described(new)}, but the graph was captured "
                    f"with {_described(static)}: capture one graph per batch size"
                )
        for static, new in zip(self._leaves, leaves):
            if isinstance(static, torch.Tensor) and new is not static:
                static.copy_(new)
        self.replay()
        return self.outputs


def _described(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {tuple(leaf.shape)}"
    return repr(leaf)


def capture_graph(
    fn: Callable[..., Any], *static_inputs: Any, num_ubatches: int = 2, warmup: int = 2,
    pool: Any = None,
) -> OverlapGraph:
    """Capture `fn` overlapped over `num_ubatches` ubatches of `static_inputs` in one CUDA graph.

    The inputs are split along dim 0 and the outputs merged as `dbo.overlap(fn)` does,
    always in ubatches. `warmup` eager runs come first, on the ubatch threads and streams
    of the capture, to do what cannot be captured: cuBLAS handles, NCCL communicators,
    the workspace at its final size. The capture hooks (`add_capture_hook`) run next: the
    process-wide workspace, if any, locks itself there for good (capture the largest batch
    first: one needing more fails in its warmup with `WorkspaceLockedError`); then one
    more run is captured: the ubatch streams fork from
    the capture stream (a side stream, current in this thread) and join back into it
    through the runner's events; the baton runs as usual. Work `fn` puts on streams of
    its own must rejoin its ubatch's stream before `fn` returns. One capture at a time,
    and no other thread may use CUDA meanwhile (`CAPTURE_ERROR_MODE`). `pool`: a
    `torch.cuda.graph_pool_handle()` shared with graphs that never replay at the same time.

    Raises before capturing: RuntimeError "CUDA graphs need a CUDA device" without a
    CUDA tensor in `static_inputs`; RuntimeError for a `dbo.overlap` wrapper (pass what
    it wraps: its options, a `decision_group`'s host read among them, are not captured)
    or inside an overlap; TypeError / ValueError for bad arguments or a batch smaller
    than `num_ubatches`; `fn`'s own errors from the warmup, where code that cannot be
    captured refuses (`capturing()`: the dynamic `comm.moe` path names `dispatch_fixed`).
    A failure during the capture ends it (no stream is left capturing), undoes the hooks
    (a workspace it locked is unlocked) and re-raises;
    the runner stays usable; the failed graph is kept (never freed) and a `pool` it used
    is refused from then on (RuntimeError: pass a new handle).

    Under capture `fn` must not: read a device value on the host (`.item()`, `.tolist()`,
    `.cpu()`, `print` of a tensor, an `if` on a tensor), copy device to host without
    blocking or `pin_memory()` (pinned host memory allocated during a capture), use a
    cuBLAS handle or NCCL communicator for the first time (the warmup runs must have
    used them: lazily created NCCL communicators included), or synchronize.
    """
    num_ubatches = _checked_arguments(fn, num_ubatches, warmup, pool)
    device = _cuda_device(static_inputs)
    parts = _split(static_inputs, num_ubatches)
    capture, marked = _Capture(device, pool), _marked(fn)
    with runner_pool.lease(num_ubatches, None) as runner, capture.current_stream():
        for _ in range(warmup):
            default_merge(runner.run(marked, parts, device=device))
        # A failure in the captured run ends the capture first, then undoes the hooks.
        with _capture_hooks_run(), capture.capturing():
            outputs = default_merge(runner.run(marked, parts, device=device))
    return OverlapGraph(capture.graph, static_inputs, outputs)


def _checked_arguments(fn: Any, num_ubatches: Any, warmup: Any, pool: Any) -> int:
    """`capture_graph`'s argument checks; the ubatch count."""
    if not callable(fn):
        raise TypeError(f"dbo.capture_graph needs a callable, got {fn!r}")
    if type(warmup) is not int or warmup < 1:
        raise (ValueError if type(warmup) is int else TypeError)(
            "warmup must be an int >= 1 (the eager runs before the capture initialize what "
            f"cannot be captured: cuBLAS handles, communicators, the workspace), got {warmup!r}"
        )
    if pool is not None and not (
        isinstance(pool, tuple) and len(pool) == 2 and all(type(i) is int for i in pool)
    ):
        raise TypeError(f"pool must be a torch.cuda.graph_pool_handle() or None, got {pool!r}")
    if pool is not None and pool in _Capture.failed_pools:
        raise RuntimeError(
            f"pool={pool!r} was used by a capture that failed, which can leave the memory "
            "pool's allocator state behind; pass a new torch.cuda.graph_pool_handle() (and "
            "capture again the graphs that shared this one)"
        )
    if current_context() is not None:
        raise RuntimeError("dbo.capture_graph was called inside an overlap; call it outside")
    if isinstance(fn, Overlapped):
        raise RuntimeError(
            "dbo.capture_graph got a dbo.overlap wrapper; pass the function it wraps "
            f"({getattr(fn, '__wrapped__', fn)!r}), which capture_graph splits, overlaps and "
            "merges itself (num_ubatches=). A wrapper's options are not captured: a "
            "decision_group reads the batch sizes on the host at every call, and a graph "
            "overlaps at every replay"
        )
    return check_num_ubatches(num_ubatches)


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, marking its run as one of `capture_graph`'s for `capturing()`."""

    def in_capture_graph(*args: Any, **kwargs: Any) -> Any:
        state = run_state()
        assert state is not None, "capture_graph runs fn in the ubatch threads of a run"
        state[IN_CAPTURE] = True
        return fn(*args, **kwargs)

    return in_capture_graph


def _cuda_device(static_inputs: tuple[Any, ...]) -> torch.device:
    """The device of the first CUDA tensor in `static_inputs`; RuntimeError without one."""
    devices = [leaf.device for leaf in tree_leaves(static_inputs) if isinstance(leaf, torch.Tensor)]
    for device in devices:
        if device.type == "cuda":
            return device
    found = ", ".join(sorted({str(device) for device in devices})) or "no tensor"
    raise RuntimeError(
        f"CUDA graphs need a CUDA device, but the static inputs of dbo.capture_graph hold "
        f"{found}; pass CUDA tensors (dbo.overlap runs the same function eagerly anywhere)"
    )


def _split(static_inputs: tuple[Any, ...], num_ubatches: int) -> UBatchInputs:
    """`static_inputs` split along dim 0 into `num_ubatches` parts (views)."""
    size = batch_size_of(splittable_leaves(static_inputs, {}))
    if size is None or size < num_ubatches:
        held = "no tensor with a dim 0" if size is None else f"a batch of {size}"
        raise ValueError(
            f"dbo.capture_graph splits its static inputs along dim 0 into "
            f"num_ubatches={num_ubatches} parts, but they hold {held}; capture a batch of "
            "at least num_ubatches rows (pad a decode batch to a captured size)"
        )
    return split_parts(static_inputs, {}, num_ubatches, size)


_capture_hooks: list[Callable[[], Callable[[], None] | None]] = []
_capture_hooks_lock = threading.Lock()


def add_capture_hook(hook: Callable[[], Callable[[], None] | None]) -> Callable[[], None]:
    """Call `hook()` in every `dbo.capture_graph`, after its warmup runs and before it
    captures, in the calling thread; returns what removes the hook.

    For libraries whose state a captured graph depends on: the workspace locks itself
    here, so that the graph holds its final addresses. `hook` returns what undoes its
    work if the capture fails (or None); an exception in it fails the capture before
    anything is captured. Hooks run in the order they were added.
    """
    if not callable(hook):
        raise TypeError(f"add_capture_hook needs a callable, got {hook!r}")
    with _capture_hooks_lock:
        _capture_hooks.append(hook)

    def remove() -> None:
        with _capture_hooks_lock, contextlib.suppress(ValueError):
            _capture_hooks.remove(hook)

    return remove


@contextlib.contextmanager
def _capture_hooks_run() -> Iterator[None]:
    """Run the capture hooks, then the body; if either raises, undo the hooks that ran
    (in reverse order) and re-raise."""
    with _capture_hooks_lock:
        hooks = list(_capture_hooks)
    with contextlib.ExitStack() as undo:
        for hook in hooks:
            done = hook()
            if done is not None:
                undo.callback(done)
        yield
        undo.pop_all()  # the capture succeeded: the hooks' work stays


class _Capture:
    """One CUDA-graph capture on a side stream of `device`, and its cleanup on failure."""

    failed_graphs: list[Any] = []
    """The graphs of failed captures, kept alive for good: recent torch's capture_begin
    also routes host (pinned) allocations through the graph object, and a failed
    capture_end leaves that routing in place; freeing the object would leave it dangling."""
    failed_pools: set[Any] = set()
    """Memory pools (`pool=`) a failed capture used: their allocator state is not trusted."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def current_stream(self) -> Iterator[None]:
        """A side stream current here, ordered after the caller's, for the warmup and the
        capture alike (the same streams everywhere); the caller's waits for it after. It
        is one of dbo's own (`dbo.device`), not of torch's pool, where NCCL's come from."""
        backend = CudaBackend(self.device)
        stream = backend.new_stream("capture")
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)
            backend.release_stream(stream)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Capture the body's work into `graph`. If the capture cannot begin, the body
        raises (the capture is ended: this thread began it) or the capture cannot end (an
        invalidated capture: nothing to replay), the graph is dropped and the error
        re-raised."""
        # As torch.cuda.graph does: the warmup's kernels are done and their blocks freed.
        torch.cuda.synchronize(self.device)
        try:
            self.graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):  # an invalidated capture ends with an error
                    self.graph.capture_end()
                raise
            self.graph.capture_end()
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        """Give up the graph: undo what torch's capture_end leaves undone when it fails
        (the device allocator routing this capture's allocations to the pool, and its use
        of it), keep the graph object alive for good (`failed_graphs`) and mark the pool
        as one a failed capture used (`failed_pools`)."""
        index = self.device.index
        with contextlib.suppress(Exception):  # capture_end got that far
            private.end_allocate_to_pool(index, self.pool)
        with contextlib.suppress(Exception):
            private.release_pool(index, self.pool)
        _Capture.failed_graphs.append(self.graph)
        _Capture.failed_pools.add(self.pool)
