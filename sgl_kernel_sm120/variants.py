"""Which algorithm serves a message: a pure function of (bytes, world size, link, islands).

Every rank computes the same answer from the same group-identical inputs, which is what keeps the ranks
in step: a rank that picked another variant than its peers would wait for pushes that never come.
"""

from __future__ import annotations

import enum


class Variant(enum.IntEnum):
    # Values are shared with csrc/ar_launch.h (enum class Variant).
    ONESHOT = 0  # every rank pushes everything to everyone, reduces locally: one hop, (W-1)x bytes
    TWOSHOT = 1  # flat reduce-scatter to owners + all-gather: two hops, ~2x bytes
    ISLAND = 2  # reduce-scatter inside each island, fp32 exchange between twins, all-gather: three hops


class Transport(str, enum.Enum):
    """How a call's data travels (csrc/ar_types.h enum Transport mirrors the codes; append-only)."""

    PUSH = "push"  # every rank stores into every peer's scratch at once (posted writes)
    STAGED = "staged"  # the same stores in W-1 permutation passes, one destination per pass (few CTAs)
    PULL = "pull"  # every rank stores into its own slab, the peers load from it; readiness by flags

    @property
    def code(self) -> int:
        return {"push": 0, "staged": 1, "pull": 2}[self.value]


# Staged push paces its passes CTA by CTA: it is meant for few CTAs (issue 17; FlashInfer caps its staged ring
# at 4). A seed, like every launch choice here, until the tuner measures.
STAGED_MAX_CTAS = 8


def choose_transport(nbytes: int, world_size: int, link: "Link | str") -> Transport:
    """The transport a call takes when none is forced: push for every size until the tuner measures another
    (issue 23). A pure function of group-identical inputs, like choose_variant."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return Transport.PUSH


class Link(str, enum.Enum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    HOST = "host"  # no P2P: every push goes to pinned host memory and every poll reads it (memory="host")


# Seeds. At 2 ranks one-shot beat two-shot at every size measured on 2x H200
# (benchmarks/results/allreduce_h200_tp2.json). The 4- and 8-rank bounds are unmeasured starting points: the
# NVLink one from the one-shot's (W-1)x traffic, the PCIe ones from published PCIe Gen5 P2P figures
# (all-to-all posted writes collapse on root complexes past a few tens of KB, so larger messages move to the
# staged schedules). They wait for a run on a PCIe box to be measured.
NVLINK_ONESHOT_MAX_BYTES = 512 * 1024
PCIE_ONESHOT_MAX_BYTES = {2: 1 << 62, 4: 32 * 1024, 8: 16 * 1024}
# Through host memory every byte crosses PCIe three times (the push, the reader's poll, and the reader's store
# that empties the slot, csrc/ar_protocol.cuh I11), and one-shot makes each rank read (W-1) payloads while
# two-shot reads ~2 payloads (reduce-scatter + all-gather). At 2 ranks one-shot moves the same bytes in one hop,
# so it always wins there. The 4- and 8-rank bounds are seeds from that
# arithmetic (a poll of host memory is a ~1 us round trip, so below these sizes the extra hop costs more than
# the extra reads); no box with more than 2 GPUs has measured them.
HOST_ONESHOT_MAX_BYTES = {2: 1 << 62, 4: 16 * 1024, 8: 8 * 1024}


def choose_variant(nbytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> Variant:
    """The variant the dispatch uses for a message of `nbytes` bytes.

    world_size <= 2: one-shot always (two-shot moves the same bytes in twice the hops).
    NVLink: one-shot up to NVLINK_ONESHOT_MAX_BYTES, then flat two-shot.
    PCIe: one-shot up to PCIE_ONESHOT_MAX_BYTES[world], then the island schedule when the topology gave
    two or more islands, else flat two-shot.
    Host memory: one-shot up to HOST_ONESHOT_MAX_BYTES[world], then flat two-shot (no islands).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    link = Link(link)
    if world_size <= 2:
        return Variant.ONESHOT
    if link is Link.HOST:
        return Variant.ONESHOT if nbytes <= HOST_ONESHOT_MAX_BYTES.get(world_size, 8 * 1024) else Variant.TWOSHOT
    if link is Link.NVLINK:
        return Variant.ONESHOT if nbytes <= NVLINK_ONESHOT_MAX_BYTES else Variant.TWOSHOT
    if nbytes <= PCIE_ONESHOT_MAX_BYTES.get(world_size, 16 * 1024):
        return Variant.ONESHOT
    return Variant.ISLAND if num_islands >= 2 else Variant.TWOSHOT


def oneshot_max_bytes(world_size: int, link: Link | str) -> int:
    """The largest message choose_variant ever sends one-shot (without islands): the one-shot slots of a workspace
    need hold no more (csrc/workspace.cu sizes them by it; host memory at 4 and 8 ranks is the case that saves)."""
    link = Link(link)
    if world_size <= 2:
        return 1 << 62
    if link is Link.HOST:
        return HOST_ONESHOT_MAX_BYTES.get(world_size, 8 * 1024)
    if link is Link.NVLINK:
        return NVLINK_ONESHOT_MAX_BYTES
    return PCIE_ONESHOT_MAX_BYTES.get(world_size, 16 * 1024)


def validate_islands(islands, world_size: int) -> list[list[int]] | None:
    """Check a caller-given island partition; returns it normalised, or None for 'no islands'.

    Islands must partition range(world_size) into at least two groups of equal size (the schedule pairs
    position i of every island). One island, or None, means the flat schedules only.
    """
    if islands is None:
        return None
    groups = [list(map(int, g)) for g in islands]
    if len(groups) <= 1:
        return None
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"islands {groups} must partition the ranks 0..{world_size - 1} exactly once")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"islands {groups} must all have the same size")
    return groups


def placement(groups: list[list[int]], rank: int) -> tuple[list[int], list[int], int, int]:
    """(ranks of my island by position, my twin in each island by island, my island, my position)."""
    for island, members in enumerate(groups):
        if rank in members:
            index = members.index(rank)
            twins = [g[index] for g in groups]
            return list(members), twins, island, index
    raise ValueError(f"rank {rank} is in no island of {groups}")


def schedule(max_bytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> list[tuple[int, int, Variant]]:
    """The variant of every message size from 1 to `max_bytes` bytes, as (first byte count, last, variant)
    ranges: what a log line or the doctor says about a workspace. Assumes, as choose_variant guarantees, that
    each variant serves one contiguous range of sizes."""
    ranges: list[tuple[int, int, Variant]] = []
    low = 1
    while low <= max_bytes:
        variant = choose_variant(low, world_size, link, num_islands)
        lo, hi = low, max_bytes
        while lo < hi:  # largest size still served by `variant`
            mid = (lo + hi + 1) // 2
            if choose_variant(mid, world_size, link, num_islands) is variant:
                lo = mid
            else:
                hi = mid - 1
        ranges.append((low, lo, variant))
        low = lo + 1
    return ranges


def describe_schedule(max_bytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> str:
    """'ONESHOT up to 16384 B, ISLAND up to 458752 B' for the given workspace."""
    return ", ".join(
        f"{variant.name} up to {high} B" for _, high, variant in schedule(max_bytes, world_size, link, num_islands)
    )
