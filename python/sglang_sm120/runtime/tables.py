"""Finding (or making) the routing table of one TP group when its workspace is built, before CUDA-graph capture.

Every step is collective over the group and agreed (core/exchange.py), so every rank ends with the same
`RouteBook`, and any failure anywhere ends in the seeds on every rank, with a WARNING naming why:

1. key: every rank's key facts (GPU, PCI bus id, versions: core/facts.key_facts) are exchanged and the key is
   made with the group's P2P matrix, the islands and the memory of the workspace just built;
2. lookup: every rank reads the cache (routing/cache.py) and the ranks agree; the table is used only when every
   rank read the same one (same digest) and it covers this server's dtype, hidden size and byte bound;
   a stale or corrupt one is named in a WARNING;
3. no usable table, `--sm120-allreduce-tune`:
   - off: the seeds;
   - auto (default), or force (also when a table exists): the quick tune. Rank 0 picks a free TCP port, every
     rank starts ONE child process on its own GPU (tuning/child.py: it builds its own workspaces and its own
     NCCL communicator, so nothing it does can break this process's CUDA context), the children tune
     together, each rank waits for its child (bounded by SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S, default 180 s,
     and a 60 s stall bound), the ranks agree on the outcomes; when every child delivered the same table and
     its key is this group's, rank 0 saves it to the cache and every rank routes by it. Anything else: seeds,
     and rank 0 leaves a note (routing/cache.py) so that later starts in auto mode do not run it again; `force`,
     or a table the tool saves, clears it.
The quick tune has not run on a GPU yet: its code path is real, and every failure of it ends in the seeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.facts import key_facts
from ..routing import cache
from ..routing.table import KINDS, RoutingTable, compare_keys, make_key
from ..tuning import launch
from ..tuning.candidates import KernelOffer
from ..tuning.tuner import TuneSpec
from .routes import TABLE, TUNE_COMMAND, RouteBook

logger = logging.getLogger("sglang_sm120")

STALL_S = 60.0
AGREE_MARGIN_S = 30.0


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_routes(
    *,
    agree: Callable[..., list],
    rank: int,
    world: int,
    device,
    memory: str,
    islands: Sequence[Sequence[int]] | None,
    link: str | None,
    p2p: Sequence[Sequence[bool]] | None,
    offer: KernelOffer,
    num_islands: int,
    hidden: int,
    dtype,
    max_bytes: int,
    tune: str,
    tune_timeout_s: float,
    log: Callable[[int, str], None],
    facts: Callable[[Any], dict] | None = None,
    run_child: Callable[..., launch.ChildOutcome] | None = None,
    graph_rows: Sequence[int] = (),
) -> RouteBook:
    """The group's routes (module docstring). Never raises: every failure is the seeds, logged. `facts` and
    `run_child` default to core.facts.key_facts and tuning.launch.run_rank_child (looked up at call time).
    `graph_rows`: the row counts the server runs in CUDA graphs (tuning.tuner.graph_rows), each measured by the
    quick tune."""
    facts = facts or key_facts
    run_child = run_child or launch.run_rank_child
    dtype_name = _dtype_name(dtype)
    row_bytes = int(hidden) * 2
    covered = max(row_bytes, int(max_bytes) // row_bytes * row_bytes)  # whole rows: what a tune measures

    def book(table: RoutingTable, path: str) -> RouteBook:
        return RouteBook(TABLE, table=table, path=path, memory=memory, num_islands=num_islands, offer=offer)

    def seeds(why: str, level: int = logging.WARNING) -> RouteBook:
        if why:
            log(level, f"sglang_sm120: {why}; routes: seeds ({TUNE_COMMAND} measures this box)")
        return RouteBook.seeds(why)

    try:
        # 1. the key
        local: dict[str, Any] = {}
        try:
            local = {"facts": facts(device)}
        except Exception as exc:  # noqa: BLE001 - agreed below
            local = {"error": f"{type(exc).__name__}: {exc}"}
        everyone = agree("routes-key", local)
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e.get("error")]
        if errors:
            return seeds(f"the routing-table key could not be computed ({'; '.join(errors)})")
        key = make_key([e["facts"] for e in everyone], islands=islands, p2p=p2p, memory=memory)

        # 2. the lookup
        loaded = cache.load(key, hidden=hidden, dtype=dtype_name, max_bytes=covered, kinds=KINDS)
        views = agree("routes-load", {"status": loaded.status, "reason": loaded.reason, "path": loaded.path,
                                      "digest": loaded.table.digest() if loaded.ok else None})
        found = all(v["status"] == cache.OK for v in views) and len({v["digest"] for v in views}) == 1
        if found and tune != "force":
            return book(loaded.table, loaded.path)
        why, missing = "", False
        if not found:
            statuses = {v["status"] for v in views}
            if statuses - {cache.MISSING}:
                first = next(v for v in views if v["status"] != cache.MISSING)
                why = (f"routing table {first['path']} ignored: {first['status']} ({first['reason']})"
                       if len(statuses) == 1 else f"the ranks read different routing tables ({sorted(statuses)})")
            else:
                why, missing = f"no routing table of this box in {cache.cache_dir()}", True
        if tune == "off":
            # No table is what the activation line says already; a stale or broken one deserves its own warning.
            return seeds(f"{why} (--sm120-allreduce-tune off)" if why else "",
                         logging.INFO if missing else logging.WARNING)
        if tune == "auto":
            notes = agree("routes-failed-before", cache.recorded_failure(key, hidden))
            if all(notes):
                return seeds(f"the quick tune failed on this box on {notes[0]['when']} ({notes[0]['why']}) and is not "
                             f"run again ({notes[0]['path']}; --sm120-allreduce-tune force retries it)")
        if why:
            log(logging.WARNING, f"sglang_sm120: {why}; measuring a quick one now (--sm120-allreduce-tune {tune})")
        else:
            log(logging.WARNING, "sglang_sm120: measuring the routes again (--sm120-allreduce-tune force)")

        # 3. the quick tune, in one child process per rank
        port = agree("routes-port", launch.free_port() if rank == 0 else None)[0]
        spec = TuneSpec.make(hidden, covered // row_bytes, quick=True, dtypes=[dtype_name], kinds=list(KINDS),
                             memory=memory, islands=[list(g) for g in islands] if islands else None,
                             islands_given=True, link=link, graph_rows=sorted({int(r) for r in graph_rows}))
        start = time.monotonic()
        outcome = run_child(rank, world, int(device.index), int(port), spec, timeout_s=tune_timeout_s,
                            stall_s=min(STALL_S, tune_timeout_s))
        outcomes = agree("routes-tuned", launch.outcome_payload(outcome), timeout_s=tune_timeout_s + AGREE_MARGIN_S)
        failed = [f"rank {r}: {o['why']}" for r, o in enumerate(outcomes) if not o["ok"]]
        problem = ""
        if failed:
            problem = f"the quick tune at start-up failed ({'; '.join(failed)})"
        elif len({o["digest"] for o in outcomes}) != 1:
            problem = "the quick tune at start-up gave the ranks different tables"
        else:
            table = RoutingTable.from_dict(outcome.table)
            mismatch = compare_keys(key, table.key)
            if mismatch is not None:
                problem = (f"the quick tune measured under another key than the server's ({mismatch[0]}: "
                           f"{mismatch[1]})")
        if problem:
            if rank == 0:
                try:
                    cache.record_failure(key, hidden, problem, time.strftime("%Y-%m-%d %H:%M:%S"))
                except OSError as exc:
                    logger.warning("sglang_sm120: noting the failed quick tune: %s", exc)
            return seeds(problem)
        table.durations["total"] = round(time.monotonic() - start, 3)
        saved: dict[str, Any] = {"path": None, "error": None}
        if rank == 0:
            try:
                saved["path"] = cache.save(table)
            except OSError as exc:
                saved["error"] = f"{type(exc).__name__}: {exc}"
        saved = agree("routes-saved", saved)[0]
        if saved["error"]:
            log(logging.WARNING, f"sglang_sm120: the quick tune's table could not be saved ({saved['error']}); "
                                 "routing by it in this server only")
        return book(table, saved["path"] or "(not saved)")
    except Exception as exc:  # noqa: BLE001 - the seeds are always a safe answer
        logger.warning("sglang_sm120 [rank %d]: resolving the routes failed: %s: %s", rank, type(exc).__name__, exc)
        return seeds(f"resolving the routes failed ({type(exc).__name__}: {exc})")
