"""The data-path probe at construction, host side (the device side is csrc/probe.cu, rounds R1-R4 there).

`cudaDeviceCanAccessPeer` can say yes where the data does not arrive intact (PCIe ACS redirection, a translating
IOMMU, a mapping broken for part of a slab). So in rounds every rank writes tagged packs at the edges of every area
the kernels write in every peer's scratch, then loads tagged packs from the edges of every peer's pull area,
through the kernels' own paths (bounded polls that never trap), and reports what arrived; the ranks agree after
each round, which is also the barrier between rounds. The first failed round raises IpcAllReduceProbeError on
every rank, naming the pairs, the direction and the area.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .construction import joint_check
from .env import setting
from .errors import IpcAllReduceProbeError

logger = logging.getLogger(__name__)

# The probe runs right after a gloo collective, so every rank's pushes land within milliseconds on a healthy
# fabric; a few seconds also covers ranks time-slicing one GPU in the tests.
PROBE_TIMEOUT_S = 5.0
# Debug switch for the tests (`drop_target`): rank SRC's probe skips its writes to rank DST and corrupts its loads
# from DST, in every round, in one round, or in the read rounds only (a read path that returns garbage).
PROBE_DROP_ENV = "SGL_SM120_DEBUG_PROBE_DROP"
PROBE_DROP_READS = "read"
# csrc/ar_types.h ProbeOutcome, per (sender, receiver): in a read round the sender is the rank whose slab the
# receiver loaded from.
OUTCOMES = {
    1: "ok",
    2: "write never arrived",
    3: "wrong data arrived",
    4: "rank {receiver}'s loads from rank {sender} never returned the pattern",
    5: "rank {receiver}'s loads from rank {sender} returned wrong data",
}
OK = 1


def drop_target(rank: int, environ=None, round_index: int | None = None, memory: str = "device",
                reads: bool | None = None) -> int:
    """The peer this rank's probe fails with (debug switch) in `round_index` (None: any round), else -1.

    SRC:DST[:ROUND|:read][@MEMORY]: in a write round rank SRC skips its probe writes to DST; in a read round
    (`reads`: whether `round_index` is one; None: unknown, any) rank SRC's loads from DST see a wrong pattern
    (csrc/probe.cu). ROUND is a round number, or `read` for every read round (the write rounds come first, so
    without it a drop fails a write round). The switch stands for what ACS redirection or a translating IOMMU do
    to P2P traffic, so by default it applies to device-memory workspaces only (MEMORY device); a host-memory
    workspace, which crosses no P2P path, is probed untouched, as the overlay's retry in host memory needs. @host
    or @any make the host-memory probe fail too (its own tests)."""
    raw = setting(PROBE_DROP_ENV, "", environ).strip()
    if not raw:
        return -1
    spec, _, applies_to = raw.partition("@")
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or applies_to not in ("", "device", "host", "any"):
            raise ValueError
        src, dst = int(parts[0]), int(parts[1])
        when = parts[2] if len(parts) == 3 else None
        if when is not None and when != PROBE_DROP_READS:
            int(when)
    except ValueError:
        raise ValueError(
            f"{PROBE_DROP_ENV}={raw!r} must be SRC:DST, SRC:DST:ROUND or SRC:DST:{PROBE_DROP_READS} (rank and round "
            "numbers), optionally followed by @device (the default), @host or @any"
        ) from None
    if (applies_to or "device") not in (memory, "any"):
        return -1
    if src != rank:
        return -1
    if when == PROBE_DROP_READS:
        if reads is False:
            return -1
    elif when is not None and round_index is not None and int(when) != round_index:
        return -1
    return dst


def failed_pairs(outcomes_by_receiver: list[list[int]], where: str = "") -> list[tuple[int, int, str]]:
    """(sender, receiver, what) for every pair whose probe pack did not arrive intact (`where`: the round); in a
    read round the receiver loaded from the sender's slab."""
    suffix = f" ({where})" if where else ""
    return [
        (sender, receiver,
         OUTCOMES.get(outcome, "outcome {outcome}").format(sender=sender, receiver=receiver, outcome=outcome)
         + suffix)
        for receiver, row in enumerate(outcomes_by_receiver)
        for sender, outcome in enumerate(row)
        if sender != receiver and outcome != OK
    ]


def run(ops, handle: int, group, rank: int, world_size: int, memory: str,
        timeout_s: float) -> tuple[int, tuple[int, ...]]:
    """Every round of the probe on a built workspace (collective). Returns (rounds, the read rounds among them);
    raises IpcAllReduceProbeError on every rank at the first round that failed anywhere, with the peers' slabs
    already unmapped on every rank (a write that was only slow could still land: close() frees the slab later)."""
    rounds = int(ops.ws_probe_rounds(handle))
    read_rounds = tuple(r for r in range(rounds) if bool(ops.ws_probe_round_reads(handle, r)))
    for round_index in range(rounds):
        error, outcomes = None, None
        try:
            drop = drop_target(rank, round_index=round_index, memory=memory, reads=round_index in read_rounds)
            outcomes = [int(o) for o in ops.ws_probe(handle, min(PROBE_TIMEOUT_S, timeout_s), round_index, drop)]
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        joint_check(group, error, "data-path probe")
        table: list = [None] * world_size
        dist.all_gather_object(table, outcomes, group=group)
        failed = failed_pairs(table, str(ops.ws_probe_round_name(handle, round_index)))
        if failed:
            # Every rank reaches the barrier and raises the probe's error, also when unmapping fails here: a rank
            # that raised something else first would skip the barrier (its peers wait there) and the overlay's
            # retry in host memory, which looks for the probe's error on every rank.
            try:
                ops.ws_close_peers(handle)
            except Exception as exc:
                logger.warning("sgl_kernel_sm120 rank %d: unmapping the peers after the failed probe: %s: %s",
                               rank, type(exc).__name__, exc)
            dist.barrier(group=group)
            raise IpcAllReduceProbeError(failed)
    return rounds, read_rounds
