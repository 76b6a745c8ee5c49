"""The data-path probe at construction, host side (the device side is csrc/probe.cu, P1-P5 there; what it writes
and loads where, and why `cudaDeviceCanAccessPeer` is not enough: docs/design.md). One kernel per rank and one
exchange round for the group; a failure raises IpcAllReduceProbeError on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .errors import IpcAllReduceProbeError
from .exchange import agree, attempt
from .settings import ProbeDrop

logger = logging.getLogger(__name__)

# A healthy fabric delivers the probe's packs within milliseconds; seconds also cover ranks time-slicing one GPU.
PROBE_TIMEOUT_S = 5.0
UNMAP_BARRIER_TIMEOUT_S = 60.0
OK = 0  # csrc/ar_types.h ProbeOutcome, and 0 for a peer whose every place was fine
WRITES, READS = 0, 1  # the kinds of a peer's outcome (csrc/ar_types.h ProbeOutcomes)
OUTCOMES = {  # csrc/ar_types.h ProbeOutcome; in a load the sender is the rank whose slab the receiver loaded
    2: "write never arrived",
    3: "wrong data arrived",
    4: "rank {receiver}'s loads from rank {sender} never returned the pattern",
    5: "rank {receiver}'s loads from rank {sender} returned wrong data",
}
# The debug switch's parts as csrc/probe.cu takes them: 1 its writes, 2 its loads, 4 the last page only.
DROP_MODES = {None: 1 | 2, "write": 1, "read": 2, "last": 1 | 4}


def drop_target(drop: ProbeDrop | None, rank: int, memory: str) -> tuple[int, int]:
    """(the peer this rank's probe fails with, what it drops: DROP_MODES), or (-1, 0): the debug switch. It stands
    for what a broken P2P path does, so it spares host-memory workspaces unless it names them (the overlay's retry
    in host memory needs a clean probe there)."""
    if drop is None or drop.src != rank or drop.memory not in (memory, "any"):
        return -1, 0
    return drop.dst, DROP_MODES[drop.part]


def failed_pairs(tables: list[list[int]], place_name: Callable[[int], str] = str) -> list[tuple[int, int, str]]:
    """(sender, receiver, what) for every pair whose probe did not pass. tables[receiver] holds, per sender, the
    ws_probe op's four numbers: what arrived from it and where a place failed, then what the receiver's loads from it
    returned and where (`place_name` names a slab offset)."""
    pairs = []
    for receiver, row in enumerate(tables):
        for sender in range(len(row) // 4):
            for kind in (WRITES, READS):
                outcome, at = row[4 * sender + 2 * kind], row[4 * sender + 2 * kind + 1]
                if sender != receiver and outcome != OK:
                    what = OUTCOMES.get(outcome, "outcome {outcome}").format(sender=sender, receiver=receiver,
                                                                            outcome=outcome)
                    pairs.append((sender, receiver, f"{what} ({place_name(at)})" if at >= 0 else what))
    return pairs


def run(ops, handle: int, exchange, memory: str, timeout_s: float, drop: ProbeDrop | None = None) -> None:
    """The probe on a built workspace (collective, one round). On a failure every rank unmaps its peers, waits until
    all have, and raises IpcAllReduceProbeError (a write that was only slow could still land: close() frees the slab
    later)."""
    peer, mode = drop_target(drop, exchange.rank, memory)
    tables = agree(exchange, "data-path probe", *attempt(
        lambda: [int(v) for v in ops.ws_probe(handle, min(PROBE_TIMEOUT_S, timeout_s), peer, mode)]))
    failed = failed_pairs(tables, lambda at: str(ops.ws_probe_place_name(handle, at)))
    if not failed:
        return
    # Every rank raises the probe's error, also when unmapping or the barrier fails: the overlay's retry in host
    # memory looks for it on every rank.
    for what, step in (("unmapping the peers", lambda: ops.ws_close_peers(handle)),
                       ("waiting for every rank to unmap", lambda: exchange.barrier(UNMAP_BARRIER_TIMEOUT_S))):
        try:
            step()
        except Exception as exc:
            logger.warning("sgl_kernel_sm120 rank %d: %s after the failed probe: %s: %s", exchange.rank, what,
                           type(exc).__name__, exc)
    raise IpcAllReduceProbeError(failed)
