"""Per-ubatch duplicate process groups, so two ubatches' collectives can be in flight at once.

A process group runs its collectives in order (gloo queues a second one behind the
first; an NCCL communicator runs them on one internal stream), so inside an overlap
ubatch i's collectives go to duplicate `i % n` of their base group, and the ubatches'
transfers proceed independently (`benchmarks/comm_overlap.py` measures both).

The order stays matched across ranks: every rank launches in the order the baton gives
the ubatches, which depends only on the program, so each group sees the same sequence of
collectives on every rank. That needs the same number of ubatches on every rank:
`dbo.overlap` runs `fn` inline on the base group when a rank's batch is too small, so
pass `decision_group=`, give every rank the same batch size, or use a `dbo.UBatchRunner`.

Creating groups is a collective over the world (`ubatch_groups`; `init_distributed` does
it for the default group). Inside an overlap none are created: a collective without
duplicates uses its base group (correct, but one ubatch after another) and warns once.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm._checks import resolve_group, still_registered


class UBatchGroupRegistry:
    """The duplicate groups created so far, per base group (one per process).

    `timeout_s` (set by `init_distributed`; None: torch's default) is the timeout of the
    default group's duplicates; a subgroup's get the subgroup's own (else `timeout_s`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._duplicates: dict[dist.ProcessGroup, list[dist.ProcessGroup]] = {}
        # As a non-member, per (ranks, backend, key): what the members count per group.
        self._created_as_non_member: dict[tuple[tuple[int, ...], str, Hashable], int] = {}
        self.timeout_s: float | None = None
        self._world: weakref.ref[dist.ProcessGroup] | None = None  # of those counts
        self._checked: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
        """Groups with too few duplicates that `lookup` has seen (and warned of)."""

    def lookup(
        self, base: dist.ProcessGroup, ubatch_id: int, num_ubatches: int = 0
    ) -> dist.ProcessGroup:
        """The group ubatch `ubatch_id` uses for `base`: duplicate `ubatch_id % n`, else
        `base` itself. With fewer duplicates than `num_ubatches` (0: not checked) the
        ubatches share a communicator: a RuntimeWarning, once per group."""
        duplicates = self._duplicates.get(base) or []
        if num_ubatches > len(duplicates) and num_ubatches > 1 and base not in self._checked:
            self._checked.add(base)
            # Not for a duplicate passed on purpose, nor without a peer to wait for.
            if not self._is_duplicate(base) and base.size() > 1:
                warnings.warn(
                    f"comm: group {base.group_name!r} ({base.size()} ranks) has "
                    f"{len(duplicates)} per-ubatch duplicates for {num_ubatches} ubatches, so "
                    "their collectives on it run one after another (and an NCCL communicator "
                    "first used inside the overlap can deadlock). Create them on every rank, "
                    f"outside any overlap: comm.ubatch_groups(group, {num_ubatches})",
                    RuntimeWarning, stacklevel=4,
                )
        if not duplicates:
            return base
        return duplicates[ubatch_id % len(duplicates)]

    def base_named(self, name: str) -> dist.ProcessGroup | None:
        """The base group named `name` that has duplicates, if any."""
        return next((base for base in self._duplicates if base.group_name == name), None)

    def get_or_create(
        self, base: dist.ProcessGroup, num_ubatches: int
    ) -> tuple[dist.ProcessGroup, ...]:
        with self._lock:
            if self._is_duplicate(base):
                raise ValueError(
                    f"group {base.group_name!r} is itself a per-ubatch duplicate; pass the "
                    "base group (the one you use in model code) to comm.ubatch_groups"
                )
            self._forget_destroyed()
            existing = self._duplicates.setdefault(base, [])
            if len(existing) < num_ubatches:
                _refuse_inside_overlap(num_ubatches - len(existing))
                ranks = dist.get_process_group_ranks(base)
                backend = str(dist.get_backend(base))
                timeout = self._timeout_for(base)
                for index in range(len(existing), num_ubatches):
                    duplicate = self._new_group(ranks, backend, index, timeout)
                    assert isinstance(duplicate, dist.ProcessGroup), (
                        "a member rank gets a group back from new_group"
                    )
                    if "nccl" in backend:  # also "cpu:gloo,cuda:nccl"
                        connect_now(duplicate)
                    existing.append(duplicate)
            return tuple(existing[:num_ubatches])

    def create_for_non_member(
        self, ranks: list[int], backend: str, num_ubatches: int, key: Hashable = None
    ) -> None:
        """A non-member's part of creating a base group's duplicates: with a `key`, only
        those not created yet for `(ranks, backend, key)`, as the members count them;
        without one, `num_ubatches` groups at every call (one call per base group)."""
        identity = (tuple(sorted(set(ranks))), backend, key)  # new_group sorts them too
        counted = key is not None  # without a key, calls cannot be told apart: no count
        with self._lock:
            self._forget_destroyed()
            created = self._created_as_non_member.get(identity, 0) if counted else 0
            if created >= num_ubatches:
                return
            _refuse_inside_overlap(num_ubatches - created)
            for index in range(created, num_ubatches):
                self._new_group(ranks, backend, index)
                if counted:
                    self._created_as_non_member[identity] = index + 1

    def _is_duplicate(self, group: dist.ProcessGroup) -> bool:
        return any(group in duplicates for duplicates in self._duplicates.values())

    def _timeout_for(self, base: dist.ProcessGroup) -> timedelta | None:
        """The timeout of `base`'s duplicates: `timeout_s` for the default group, else
        `base`'s own from its backend's options (private API); None where this torch does
        not expose it (`_new_group` then uses `timeout_s`)."""
        if base is dist.GroupMember.WORLD and self.timeout_s is not None:
            return timedelta(seconds=self.timeout_s)
        for device_type in getattr(base, "_device_types", ()):
            try:
                timeout = base._get_backend(device_type).options._timeout
            except (AttributeError, RuntimeError, TypeError):
                continue
            if isinstance(timeout, timedelta) and timeout > timedelta(0):
                return timeout
        return None

    def _new_group(
        self, ranks: list[int], backend: str, index: int, timeout: timedelta | None = None
    ) -> Any:
        # Global synchronization: the group's name comes from a counter every rank
        # advances alike (a local one differs between ranks with other group histories).
        if timeout is None and self.timeout_s is not None:
            timeout = timedelta(seconds=self.timeout_s)
        return dist.new_group(
            ranks=ranks,
            backend=backend,
            timeout=timeout,
            use_local_synchronization=False,
            group_desc=f"dbo_ubatch{index}",
            pg_options=high_priority_options(backend),
        )

    def _forget_destroyed(self) -> None:
        """Drop (and destroy, if still registered) the duplicates of base groups that
        torch's own `destroy_process_group` removed; in a new world, also forget the
        non-member counts of the old one."""
        world = dist.GroupMember.WORLD
        if self._world is None or self._world() is not world:
            self._created_as_non_member.clear()
            self._world = weakref.ref(world) if world is not None else None
        if dbo.enabled():
            return  # destroying groups waits for a call outside any overlap
        for base in [base for base in self._duplicates if not still_registered(base)]:
            for duplicate in self._duplicates.pop(base):
                if still_registered(duplicate):
                    dist.destroy_process_group(duplicate)

    def clear(self) -> list[dist.ProcessGroup]:
        """Forget every duplicate; return them (for the caller to destroy)."""
        with self._lock:
            duplicates = [group for groups in self._duplicates.values() for group in groups]
            self._duplicates.clear()
            self._created_as_non_member.clear()
            return duplicates


def _refuse_inside_overlap(count: int) -> None:
    if dbo.enabled():
        raise RuntimeError(
            f"comm.ubatch_groups would create {count} process group(s) inside an overlap; "
            "creating a group is a collective that every rank must call in the same "
            "order, so call comm.ubatch_groups on every rank outside dbo.overlap (e.g. "
            "right after comm.init_distributed)"
        )


def connect_now(group: dist.ProcessGroup) -> None:
    """Make NCCL create `group`'s communicator now, with one tiny all-reduce on every
    member: created lazily inside an overlap, while another communicator's kernels are
    in flight, it can deadlock."""
    device = getattr(group, "bound_device_id", None) or torch.device(
        "cuda", torch.cuda.current_device()
    )
    probe = torch.zeros(1, device=device)
    dist.all_reduce(probe, group=group)
    torch.cuda.current_stream(probe.device).synchronize()


_registry = UBatchGroupRegistry()


def group_registry() -> UBatchGroupRegistry:
    """The process-wide registry the collectives consult."""
    return _registry


def ubatch_groups(
    group: Any = None,
    num_ubatches: int = 2,
    *,
    ranks: list[int] | None = None,
    key: Hashable = None,
) -> tuple[dist.ProcessGroup, ...]:
    """Create (once) and return `num_ubatches` duplicates of `group` (None: the default
    group); inside an overlap `comm`'s collectives on `group` then run ubatch i on
    duplicate `i % n`, outside one they keep using `group`.

    A collective over the world whenever it creates duplicates: every rank calls it, in
    the same order relative to its other group creations, outside any overlap (inside
    one it only returns existing duplicates, else RuntimeError).

    A non-member (it got `GroupMember.NON_GROUP_MEMBER` from `new_group`) passes that
    value and `ranks=` (the base group's ranks), and gets `()`. Without `key=` it takes
    part in creating `num_ubatches` groups at every call, so call once per base group;
    with `key=` (a hashable naming the base group, the same on every rank; members
    ignore `ranks=` and `key=`) repeated calls stay in step with the members. A key
    names one group object: use a new key for a base group created again.
    """
    num_ubatches = dbo.check_num_ubatches(num_ubatches)
    try:  # on every rank, so that a bad call raises alike on members and non-members
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable, got {type(key).__name__}") from None
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # Checked here, on this rank: a bad ranks= would time out in the rendezvous.
        if ranks is None:
            raise ValueError(
                "this rank is not a member of the group; pass ranks= (the group's ranks, as "
                "given to new_group) so that it can take part in creating the duplicates"
            )
        checked = sorted({int(rank) for rank in ranks})
        me, world_size = dist.get_rank(), dist.get_world_size()
        if me in checked:
            raise ValueError(
                f"ranks={list(ranks)} contains this rank ({me}), which got NON_GROUP_MEMBER: "
                "pass the ranks of the base group it is not a member of"
            )
        if any(not 0 <= rank < world_size for rank in checked):
            raise ValueError(f"ranks={list(ranks)} must be ranks of the world [0, {world_size})")
        _registry.create_for_non_member(checked, str(dist.get_backend()), num_ubatches, key)
        return ()
    return _registry.get_or_create(resolve_group(group), num_ubatches)


def destroy_ubatch_groups() -> None:
    """Destroy every duplicate group still registered and forget them all."""
    for duplicate in _registry.clear():
        if dist.is_initialized() and still_registered(duplicate):
            dist.destroy_process_group(duplicate)


def high_priority_options(backend: str) -> Any:
    """For an NCCL duplicate: options that run its kernels on a high-priority stream, so
    that one ubatch's transfer is not queued behind the other ubatch's compute blocks;
    None (the backend's defaults) for any other backend or without NCCL."""
    options_type = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if backend != "nccl" or options_type is None:
        return None
    options = options_type()
    options.is_high_priority_stream = True
    return options
