"""Per-ubatch duplicate process groups, so two ubatches' collectives can be in flight at once.

Why: one torch.distributed process group runs its collectives (mostly) one after another,
and on gloo a second collective queued behind a first one delays it. Measured here (2
gloo ranks on loopback, `benchmarks/comm_overlap.py`): with two all-to-alls in flight on
the *same* group, the first one completed 2-5x later than when it ran alone; on two
groups (one each) the first completed about as early as alone and both finished no later
than one after the other. In the layer loop, DBO on one shared group was slower than on
per-ubatch groups in most configurations. Forcing one-at-a-time order on per-ubatch groups
(wait for the other ubatch's collective before launching) measured no better, so the
collectives do not serialize. NCCL is the same by construction: a communicator runs its
collectives in order on one internal CUDA stream per device, so on one group ubatch 1's
all-to-all queues behind ubatch 0's; a duplicate communicator per ubatch gets its own
stream. With one duplicate group per ubatch, ubatch i's collectives go to group i and
the two ubatches' transfers proceed independently (`comm.collectives` does this by
default inside an overlap, for every base group that has duplicates).

Why the order is still safe: every rank launches collectives in the order the dbo baton
gives the ubatches, which is the same on every rank (ubatch 0 runs until its first yield
point, then ubatch 1, ... in a fixed ring; the points depend on the program, never on
timing). So on every group the sequence of collectives is identical on all ranks, which
is all torch.distributed (gloo tags, NCCL communicators) needs to match them. On NCCL,
kernels of two communicators on one GPU may then run concurrently; both progress because
each uses a few SMs, and they were enqueued in the same order on every rank (NCCL's
condition for using several communicators at once). This holds as long as every rank
runs the same program with the same number of ubatches: `dbo.overlap` runs `fn` inline
(one ubatch, base group) when a rank's batch has fewer rows than `num_ubatches` or
`min_batch_size`, so a rank with few or no tokens must not take that path while the
others overlap: pass `decision_group=` to `dbo.overlap` (all ranks then decide on the
smallest batch), give every rank the same batch size, or run the ubatches with a
`dbo.UBatchRunner`, which always runs every ubatch, empty ones included.

The creation rule: `torch.distributed.new_group` is itself a collective over the world.
Every rank of the world must call `ubatch_groups(group, n)` the same number of times, in
the same order relative to its other group creations, outside any overlap (a non-member
passes `ranks=`, and `key=` if it may call more than once for one base group); it
creates only the duplicates a group does not have yet, so repeating a call is harmless
on members, and on non-members that pass `key=`. `init_distributed` does it for the
default group at start-up. Creating groups lazily from one ubatch thread could
interleave differently with the other ubatch's collectives on different ranks, so
inside an overlap `ubatch_groups` only returns groups that already exist and raises
otherwise, and the collectives never create groups: without duplicates they fall back
to the base group (correct, just serialized).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dbo
from comm._checks import _still_registered, resolve_group
from dbo._checks import check_num_ubatches


class UBatchGroupRegistry:
    """The duplicate groups created so far, per base group (one per process).

    `timeout_s` (set by `init_distributed`; None: the torch.distributed default) is the
    timeout of the default group's duplicates, which carry every collective made inside
    an overlap without a group: what `init_distributed(timeout_s=...)` promises, even in
    a world initialized elsewhere with another timeout. A subgroup's duplicates get the
    subgroup's own timeout (`timeout_s` where it cannot be read), so that a collective
    times out inside an overlap when the same call outside would.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._duplicates: dict[dist.ProcessGroup, list[dist.ProcessGroup]] = {}
        self._is_duplicate: set[dist.ProcessGroup] = set()
        self._created_as_non_member: dict[tuple[tuple[int, ...], str, Hashable], int] = {}
        """How many duplicates this rank helped create for a base group it is not a member
        of, per (ranks, backend, key): the member ranks' `_duplicates[base]` count, which a
        non-member (it has no group object) keeps by what identifies the base group; only
        calls with a `key` are counted."""
        self.timeout_s: float | None = None
        self._world: weakref.ref[dist.ProcessGroup] | None = None
        """The default group the non-member counts are about (weakly)."""

    def lookup(self, base: dist.ProcessGroup, ubatch_id: int) -> dist.ProcessGroup:
        """The group ubatch `ubatch_id` uses for `base`: its duplicate, else `base` itself.

        With fewer duplicates than ubatches, ubatch i uses duplicate `i % n` (ubatches that
        share a group are serialized on it, still in the same order on every rank).
        """
        duplicates = self._duplicates.get(base)
        if not duplicates:
            return base
        return duplicates[ubatch_id % len(duplicates)]

    def get_or_create(self, base: dist.ProcessGroup, num_ubatches: int) -> tuple[
        dist.ProcessGroup, ...
    ]:
        with self._lock:
            if base in self._is_duplicate:
                raise ValueError(
                    f"group {base.group_name!r} is itself a per-ubatch duplicate; pass the "
                    "base group (the one you use in model code) to comm.ubatch_groups"
                )
            self._forget_destroyed()
            existing = self._duplicates.setdefault(base, [])
            if len(existing) < num_ubatches:
                if dbo.enabled():
                    raise RuntimeError(
                        f"comm.ubatch_groups(group, {num_ubatches}) would create "
                        f"{num_ubatches - len(existing)} process group(s) inside an overlap; "
                        "creating a group is a collective that every rank must call in the "
                        "same order, so call comm.ubatch_groups on every rank outside "
                        "dbo.overlap (e.g. right after comm.init_distributed)"
                    )
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
                    self._is_duplicate.add(duplicate)
            return tuple(existing[:num_ubatches])

    def create_for_non_member(
        self, ranks: list[int], backend: str, num_ubatches: int, key: Hashable = None
    ) -> None:
        """The part of the collective group creation a rank outside the base group does.

        With a `key`, it mirrors `get_or_create` on the members: only the duplicates not
        created yet for the base group identified by `(ranks, backend, key)` (a
        non-member has no group object), so that every rank of the world calls
        `new_group` equally often however often it is called. Without one, it creates
        `num_ubatches` groups at every call: right for one call per base group, however
        many base groups share these ranks (a count per ranks alone would merge them).
        """
        identity = (tuple(sorted(set(ranks))), backend, key)  # new_group sorts them too
        counted = key is not None  # without a key, calls cannot be told apart: no count
        with self._lock:
            self._forget_destroyed()
            created = self._created_as_non_member.get(identity, 0) if counted else 0
            if created >= num_ubatches:
                return
            if dbo.enabled():
                raise RuntimeError(
                    f"comm.ubatch_groups(group, {num_ubatches}, ranks={list(ranks)}) would "
                    f"create {num_ubatches - created} process group(s) inside an overlap; "
                    "creating a group is a collective that every rank must call in the same "
                    "order, so call comm.ubatch_groups on every rank outside dbo.overlap"
                )
            for index in range(created, num_ubatches):
                self._new_group(ranks, backend, index)
                if counted:
                    self._created_as_non_member[identity] = index + 1

    def _timeout_for(self, base: dist.ProcessGroup) -> timedelta | None:
        """The timeout of `base`'s duplicates (None: `_new_group` uses `timeout_s`)."""
        if base is dist.GroupMember.WORLD and self.timeout_s is not None:
            return timedelta(seconds=self.timeout_s)
        return _timeout_of(base)

    def _new_group(
        self, ranks: list[int], backend: str, index: int, timeout: timedelta | None = None
    ) -> Any:
        # Every rank of the world takes part (use_local_synchronization=False): then the
        # group's name comes from a counter that every rank advances alike. With local
        # synchronization the name hashes the number of groups *this* rank belongs to,
        # which differs between ranks with different group histories: they would
        # rendezvous under different names and wait until the timeout.
        if timeout is None and self.timeout_s is not None:
            timeout = timedelta(seconds=self.timeout_s)
        return dist.new_group(
            ranks=ranks,
            backend=backend,
            timeout=timeout,
            use_local_synchronization=False,
            group_desc=f"dbo_ubatch{index}",
        )

    def _forget_destroyed(self) -> None:
        """Drop the duplicates of base groups that no longer exist: destroyed by torch's
        own `destroy_process_group()`, which takes every group with the world, or a
        subgroup alone (then its duplicates still exist, and are destroyed here; a
        duplicate is only destroyed twice by mistake, an error). In a new world, also
        forget what this rank created as a non-member of the old one's groups."""
        world = dist.GroupMember.WORLD
        if self._world is None or self._world() is not world:
            self._created_as_non_member.clear()
            self._world = weakref.ref(world) if world is not None else None
        if dbo.enabled():
            return  # destroying groups waits for a call outside any overlap
        for base in [base for base in self._duplicates if not _still_registered(base)]:
            for duplicate in self._duplicates.pop(base):
                self._is_duplicate.discard(duplicate)
                if _still_registered(duplicate):
                    dist.destroy_process_group(duplicate)

    def clear(self) -> list[dist.ProcessGroup]:
        """Forget every duplicate; return them (for the caller to destroy)."""
        with self._lock:
            duplicates = [group for groups in self._duplicates.values() for group in groups]
            self._duplicates.clear()
            self._is_duplicate.clear()
            self._created_as_non_member.clear()
            return duplicates


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """`group`'s own collective timeout, or None where this torch does not expose it.

    Read from the backend's options (gloo and NCCL keep it there); private API, hence
    the guard: None makes the caller fall back to the registry's timeout.
    """
    for device_type in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device_type).options._timeout
        except (AttributeError, RuntimeError, TypeError):
            continue
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    return None


def connect_now(group: dist.ProcessGroup) -> None:
    """Make NCCL create `group`'s communicator now, outside any overlap.

    Without a device bound to the default group (`init_process_group(device_id=...)`,
    which `comm.init_distributed` passes, but a world initialized elsewhere may not),
    NCCL creates a communicator at its first collective. For a per-ubatch duplicate that
    would happen inside an overlap, in a ubatch thread holding the baton, while the other
    ubatch's collective is in flight: a blocking, device-synchronizing step that NCCL
    warns can deadlock with another communicator's kernels. One tiny all-reduce here, on
    every member in the same order (group creation is collective already), does it early.
    """
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
    """Create (once) and return `num_ubatches` duplicates of `group`, one per ubatch.

    A collective over the whole world whenever it creates duplicates, like
    `torch.distributed.new_group`: every rank of the *world* must call it, in the same
    order relative to its other group creations, and outside any overlap (inside one it
    only returns existing duplicates, else raises RuntimeError). It creates only the
    duplicates `group` does not have yet: a later call with the same or a smaller
    `num_ubatches` returns the same groups without communicating; one with a larger
    `num_ubatches` creates the missing ones.

    A rank that is not a member of `group` (it got `GroupMember.NON_GROUP_MEMBER` from
    `new_group`) calls it with that value and `ranks=` the group's ranks, and gets `()`.
    Having no group object, it cannot tell which base group a call is for, so:
      - without `key=`, it takes part in creating `num_ubatches` groups at every call:
        call `ubatch_groups` once per base group (as many base groups with the same
        ranks as you like); a second call for the same group would make it create
        groups the members do not, and the next group creation would hang;
      - with `key=` (a hashable naming the base group, the same on every rank; members
        ignore `ranks=` and `key=`), it counts the duplicates per `(ranks, key)` as the
        members count them per group, so calling again, or with a larger
        `num_ubatches`, stays in step with them.

    After this call, `comm`'s collectives on `group` (or on the default group, for
    `group=None`) run ubatch i's collectives on duplicate `i % n` inside an overlap, n
    being the number of duplicates `group` has (the most any call asked for); outside
    an overlap they keep using `group`. `init_distributed` calls this for the default
    group.

    Args:
        group: the base group; None: the default (world) group.
        num_ubatches: how many duplicates, in [1, 1024] (the ubatch count you overlap
            with).
        ranks: on a non-member only (required there): the base group's ranks.
        key: on a non-member: which base group this is, to make repeated calls safe. A
            key names one group *object*: after the base group is destroyed and created
            again, use a new key (the non-member cannot see that the members' group is
            a new one, and would skip the duplicates they create).
    """
    num_ubatches = check_num_ubatches(num_ubatches)
    try:  # on every rank, so that a bad call raises alike on members and non-members
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable, got {type(key).__name__}") from None
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        if ranks is None:
            raise ValueError(
                "this rank is not a member of the group; pass ranks= (the group's ranks, as "
                "given to new_group) so that it can take part in creating the duplicates"
            )
        _registry.create_for_non_member(
            _checked_non_member_ranks(ranks), str(dist.get_backend()), num_ubatches, key
        )
        return ()
    return _registry.get_or_create(resolve_group(group), num_ubatches)


def _checked_non_member_ranks(ranks: Any) -> list[int]:
    """A non-member's `ranks=`: ranks of this world, without this rank (ValueError
    before any rendezvous, which would otherwise time out and leave the ranks' later
    group creations out of step)."""
    checked = sorted({int(rank) for rank in ranks})
    me, world_size = dist.get_rank(), dist.get_world_size()
    if me in checked:
        raise ValueError(
            f"ranks={list(ranks)} contains this rank ({me}), which got NON_GROUP_MEMBER: "
            "pass the ranks of the base group it is not a member of"
        )
    if any(not 0 <= rank < world_size for rank in checked):
        raise ValueError(f"ranks={list(ranks)} must be ranks of the world [0, {world_size})")
    return checked


def destroy_ubatch_groups() -> None:
    """Destroy every duplicate group and forget them (before destroying the world).
    Duplicates already gone (destroyed with their world by torch's own
    `destroy_process_group()`) are only forgotten."""
    for duplicate in _registry.clear():
        if dist.is_initialized() and _still_registered(duplicate):
            dist.destroy_process_group(duplicate)
