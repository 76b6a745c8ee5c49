"""The data-path probe at construction, host side (the device side is csrc/probe.cu, rounds R1-R4 there; what it
writes and loads where, and why `cudaDeviceCanAccessPeer` is not enough: docs/design.md). One exchange round per
probe round is the barrier between them; the first failed round raises IpcAllReduceProbeError on every rank.
"""

from __future__ import annotations

import logging

from .errors import IpcAllReduceProbeError
from .exchange import agree, attempt
from .settings import DEBUG_PROBE_DROP_READS, ProbeDrop

logger = logging.getLogger(__name__)

# A healthy fabric delivers the probe's packs within milliseconds of the round's start; seconds also cover ranks
# time-slicing one GPU.
PROBE_TIMEOUT_S = 5.0
UNMAP_BARRIER_TIMEOUT_S = 60.0
OK = 1
OUTCOMES = {  # csrc/ar_types.h ProbeOutcome; in a read round the sender is the rank whose slab the receiver loaded
    2: "write never arrived",
    3: "wrong data arrived",
    4: "rank {receiver}'s loads from rank {sender} never returned the pattern",
    5: "rank {receiver}'s loads from rank {sender} returned wrong data",
}


def drop_target(drop: ProbeDrop | None, rank: int, round_index: int, memory: str, reads: bool) -> int:
    """The peer this rank's probe fails with in round `round_index` (the debug switch), else -1. It stands for what
    a broken P2P path does, so it spares host-memory workspaces unless it names them (the overlay's retry in host
    memory needs a clean probe there)."""
    if drop is None or drop.src != rank or drop.memory not in (memory, "any"):
        return -1
    hit = reads if drop.round == DEBUG_PROBE_DROP_READS else drop.round in (None, round_index)
    return drop.dst if hit else -1


def failed_pairs(outcomes_by_receiver: list[list[int]], where: str = "") -> list[tuple[int, int, str]]:
    """(sender, receiver, what) for every pair whose probe pack did not arrive intact (`where`: the round)."""
    suffix = f" ({where})" if where else ""
    return [(sender, receiver, OUTCOMES.get(outcome, "outcome {outcome}").format(
                sender=sender, receiver=receiver, outcome=outcome) + suffix)
            for receiver, row in enumerate(outcomes_by_receiver)
            for sender, outcome in enumerate(row) if sender != receiver and outcome != OK]


def run(ops, handle: int, exchange, memory: str, timeout_s: float,
        drop: ProbeDrop | None = None) -> tuple[int, tuple[int, ...]]:
    """Every round of the probe on a built workspace (collective). Returns (rounds, the read rounds among them).
    On a failed round every rank unmaps its peers, waits until all have, and raises IpcAllReduceProbeError (a write
    that was only slow could still land: close() frees the slab later)."""
    rounds = int(ops.ws_probe_rounds(handle))
    read_rounds = tuple(r for r in range(rounds) if bool(ops.ws_probe_round_reads(handle, r)))
    for index in range(rounds):
        target = drop_target(drop, exchange.rank, index, memory, index in read_rounds)
        table = agree(exchange, "data-path probe", *attempt(
            lambda index=index, target=target: [int(o) for o in ops.ws_probe(
                handle, min(PROBE_TIMEOUT_S, timeout_s), index, target)]))
        failed = failed_pairs(table, str(ops.ws_probe_round_name(handle, index)))
        if failed:
            # Every rank raises the probe's error, also when unmapping or the barrier fails: the overlay's retry in
            # host memory looks for it on every rank.
            for what, step in (("unmapping the peers", lambda: ops.ws_close_peers(handle)),
                               ("waiting for every rank to unmap", lambda: exchange.barrier(UNMAP_BARRIER_TIMEOUT_S))):
                try:
                    step()
                except Exception as exc:
                    logger.warning("sgl_kernel_sm120 rank %d: %s after the failed probe: %s: %s", exchange.rank,
                                   what, type(exc).__name__, exc)
            raise IpcAllReduceProbeError(failed)
    return rounds, read_rounds
