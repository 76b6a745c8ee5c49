"""Finding (or making) the routing table of one TP group when its workspace is built, before CUDA-graph capture.

Every step is collective over the group and agreed (core/exchange.py), so every rank ends with the same
`RouteBook` (routing/book.py). No measured table that can be used means NCCL for every size, on every rank,
with one WARNING on rank 0 naming the cause and the retry; the unmeasured seeds run only when the user asks for
them (`--sm120-allreduce-tune off`):

0. the kernels: every rank's kernel library (file, size, time: the overlay and the kernels are one version, so
   one library is one policy) and how its workspace launches (core/facts.launch_facts: agreed cluster sizes, SM
   budget, PDL, their switches) are exchanged; a rank that differs in either ends the group on NCCL, whatever
   the tune setting, since ranks that ran different kernels would wait on each other;
1. key: every rank's key facts (GPU, PCI bus id, versions: core/facts.key_facts) are exchanged and the key is
   made with the group's P2P matrix, the islands, the workspace memory and the launch facts; the candidates
   blamed for a crash or hang under this key (routing/cache.py) are read and agreed;
2. lookup: every rank reads the cache and the ranks agree; the table is used only when every rank read the
   same one (same digest) and it covers this server's dtype, hidden size and byte bound; a stale or corrupt
   one is named in a WARNING. Its routes are chosen again from its measurements without the blamed
   candidates; where that differs from what it stores, a WARNING says so and the re-derived routes serve;
3. no usable table, `--sm120-allreduce-tune`:
   - off: the seeds (unmeasured; the activation line says so);
   - auto (default): NCCL if a quick tune of this key failed before (its note, routing/cache.py), else the
     quick tune; force (also when a table exists): the quick tune. Rank 0 picks a free TCP port, every rank
     starts ONE child process on its own GPU (tuning/child.py: it builds its own workspaces and its own NCCL
     communicator, so nothing it does can break this process's CUDA context), the children tune together
     (without the blamed candidates), each rank waits for its child (bounded by
     SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S, default 180 s, and a 60 s stall bound), the ranks agree on the
     outcomes; when every child delivered the same table and its key is this group's, rank 0 saves it and
     every rank routes by it. Anything else: rank 0 leaves a note (so that later auto starts do not run it
     again) and blames the candidate a crashed or hung child was running; then NCCL, or with `force` the
     table that was there before;
4. the ranks agree that they ended on the same routes (else NCCL on every rank); any exception is NCCL.
The quick tune has not run on a GPU of the target box yet: its code path is real, and every failure of it ends
in NCCL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sgl_kernel_sm120.policy import ELEMENT_BYTES, KernelLimits, WorkspaceShape

from ..core.facts import key_facts, library_identity
from ..routing import cache
from ..routing.book import ALL_NCCL, RETRY, TABLE, RouteBook
from ..routing.table import KINDS, RoutingTable, compare_keys, make_key, route_differences
from ..tuning import launch
from ..tuning.tuner import TuneSpec

logger = logging.getLogger("sglang_sm120")

STALL_S = 60.0
AGREE_MARGIN_S = 30.0


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _differing(views: Sequence[Mapping[str, Any]], field: str) -> str:
    """'' when every rank reported the same `field`; else 'field: rank 0 a, rank 1 b'."""
    values = [v.get(field) for v in views]
    if all(value == values[0] for value in values):
        return ""
    return f"{field}: " + ", ".join(f"rank {r} {value}" for r, value in enumerate(values))


def _union(lists: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for entries in lists:
        for entry in entries or []:
            if dict(entry) not in out:
                out.append(dict(entry))
    return out


def resolve_routes(
    *,
    agree: Callable[..., list],
    rank: int,
    world: int,
    device,
    shape: WorkspaceShape,
    limits: KernelLimits,
    islands: Sequence[Sequence[int]] | None,
    p2p: Sequence[Sequence[bool]] | None,
    hidden: int,
    dtype,
    max_bytes: int,
    tune: str,
    tune_timeout_s: float,
    log: Callable[[int, str], None],
    launch_facts: Mapping[str, Any] | None = None,
    facts: Callable[[Any], dict] | None = None,
    library: Callable[[], str] | None = None,
    run_child: Callable[..., launch.ChildOutcome] | None = None,
    graph_rows: Sequence[int] = (),
) -> RouteBook:
    """The group's routes (module docstring). Never raises. `shape` and `limits`: the built workspace's (what it
    runs, and its library's limits); `islands`: its island partition. `log` writes rank 0's lines; `facts`,
    `library` and `run_child` default to core.facts.key_facts, core.facts.library_identity and
    tuning.launch.run_rank_child (looked up at call time)."""
    try:
        found = _resolve(agree=agree, rank=rank, world=world, device=device, shape=shape, limits=limits,
                         islands=islands, p2p=p2p, hidden=hidden, dtype=dtype,
                         max_bytes=max_bytes, tune=tune, tune_timeout_s=tune_timeout_s, log=log,
                         launch_facts=None if launch_facts is None else dict(launch_facts), facts=facts or key_facts,
                         library=library or library_identity, run_child=run_child or launch.run_rank_child,
                         graph_rows=graph_rows)
    except Exception as exc:  # noqa: BLE001 - NCCL is always a safe answer
        # WARNING on this rank: rank 0's line may only name this rank as missing, the reason is here
        logger.warning("sglang_sm120 [rank %d]: resolving the routes failed: %s: %s", rank, type(exc).__name__, exc)
        found = _all_nccl(log, f"resolving the routes failed ({type(exc).__name__}: {exc})")
    try:
        views = agree("routes-final", {"source": found.source, "why": found.why,
                                       "digest": found.table.routes_digest() if found.table is not None else None})
    except Exception as exc:  # noqa: BLE001
        if found.source == ALL_NCCL:
            return found  # NCCL already, and said so
        return _all_nccl(log, f"the ranks could not agree on their routes ({type(exc).__name__}: {exc})")
    ends = [(v["source"], v["digest"]) for v in views]
    if any(end != ends[0] for end in ends) and found.source != ALL_NCCL:
        ended = ", ".join(f"rank {r} {v['source']}" + (f" ({v['why']})" if v["why"] else "")
                          for r, v in enumerate(views))
        return _all_nccl(log, f"the ranks ended on different routes: {ended}")
    return found


def _all_nccl(log: Callable[[int, str], None], why: str) -> RouteBook:
    log(logging.WARNING, f"sglang_sm120: {why}; every all-reduce of this group goes to NCCL (retry: {RETRY})")
    return RouteBook.all_nccl(why)


def _resolve(*, agree, rank, world, device, shape, limits, islands, p2p, hidden, dtype, max_bytes, tune,
             tune_timeout_s, log, launch_facts, facts, library, run_child, graph_rows=()) -> RouteBook:
    dtype_name = _dtype_name(dtype)
    memory = shape.memory.value
    row_bytes = int(hidden) * ELEMENT_BYTES
    covered = max(row_bytes, int(max_bytes) // row_bytes * row_bytes)  # whole rows: what a tune measures

    def all_nccl(why: str) -> RouteBook:
        return _all_nccl(log, why)

    def seeds(why: str, level: int = logging.WARNING) -> RouteBook:
        if why:
            log(level, f"sglang_sm120: {why}; --sm120-allreduce-tune off: routes by the seeds, unmeasured")
        return RouteBook.seeds(shape, limits, why)

    # 0. one kernel library and one launch on every rank
    kernels = agree("routes-kernels", {"library": library(), "launch": launch_facts})
    differing = [d for d in (_differing(kernels, f) for f in ("library", "launch")) if d]
    if differing:
        return all_nccl(f"the ranks do not run the same kernels ({'; '.join(differing)})")

    # 1. the key, and what was blamed under it
    local: dict[str, Any] = {}
    try:
        local = {"facts": facts(device)}
    except Exception as exc:  # noqa: BLE001 - agreed below
        local = {"error": f"{type(exc).__name__}: {exc}"}
    everyone = agree("routes-key", local)
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e.get("error")]
    if errors:
        why = f"the routing-table key could not be computed ({'; '.join(errors)})"
        return seeds(why) if tune == "off" else all_nccl(why)
    key = make_key([e["facts"] for e in everyone], islands=islands, p2p=p2p, memory=memory, launch=launch_facts)
    blamed = _union(agree("routes-blamed", cache.blames(key)))

    def book(table: RoutingTable, path: str) -> RouteBook:
        derived = table.rederived(blamed)
        differences = route_differences(table, derived)
        if differences:
            log(logging.WARNING, f"sglang_sm120: routing table {path}: its routes are not what its measurements "
                                 f"give{' without the blamed candidates' if blamed else ''} ({differences}); "
                                 "routing by the re-derived ones")
        return RouteBook(TABLE, table=derived, path=path, shape=shape, limits=limits, blamed=tuple(blamed))

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
        return seeds(why, logging.INFO if missing else logging.WARNING)
    if tune == "auto":
        notes = agree("routes-failed-before", cache.recorded_failure(key, hidden))
        if all(notes):
            return all_nccl(f"{why + '; ' if why else ''}the quick tune failed on this box on {notes[0]['when']} "
                            f"({notes[0]['why']}) and is not run again until forced ({notes[0]['path']})")
    if why:
        log(logging.WARNING, f"sglang_sm120: {why}; measuring a quick one now (--sm120-allreduce-tune {tune})")
    else:
        log(logging.WARNING, "sglang_sm120: measuring the routes again (--sm120-allreduce-tune force)")

    # 3. the quick tune, in one child process per rank
    port = agree("routes-port", launch.free_port() if rank == 0 else None)[0]
    # A host-memory workspace has no link to choose: its child finds the same one (IpcAllReduce takes none).
    link = shape.link.value if memory == "device" else None
    spec = TuneSpec.make(hidden, covered // row_bytes, quick=True, dtypes=[dtype_name], kinds=list(KINDS),
                         memory=memory, islands=[list(g) for g in islands] if islands else None,
                         islands_given=True, link=link, graph_rows=sorted({int(r) for r in graph_rows}),
                         exclude=[{**b, "reason": f"blamed before: {b['reason']}"} for b in blamed])
    start = time.monotonic()
    try:
        outcome = run_child(rank, world, int(device.index), int(port), spec, timeout_s=tune_timeout_s,
                            stall_s=min(STALL_S, tune_timeout_s))
    except Exception as exc:  # this rank's child never ran: its peers hear why at the next step, not by a timeout
        outcome = launch.ChildOutcome(rank, error=f"could not start the tune child: {type(exc).__name__}: {exc}")
    outcomes = agree("routes-tuned", launch.outcome_payload(outcome), timeout_s=tune_timeout_s + AGREE_MARGIN_S)
    failed = [f"rank {r}: {o['why']}" for r, o in enumerate(outcomes) if not o["ok"]]
    problem, culprit, table = "", None, None
    if failed:
        problem = f"the quick tune at start-up failed ({'; '.join(failed)})"
        culprit = launch.culprit_of(outcomes)
        if culprit is not None:
            problem += f"; {culprit['candidate']} is blamed and never routed to on this box"
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
            when = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                cache.record_failure(key, hidden, problem, when)
                if culprit is not None:
                    cache.record_blames(key, [culprit], when)
            except Exception as exc:  # rank 0 only: it must reach the next step with its peers
                logger.warning("sglang_sm120: noting the failed quick tune: %s: %s", type(exc).__name__, exc)
        if culprit is not None:
            blamed = _union([blamed, [culprit]])
        if found:
            log(logging.WARNING, f"sglang_sm120: {problem}; routing by the table there was before, {loaded.path} "
                                 f"(retry: {RETRY})")
            return book(loaded.table, loaded.path)
        return all_nccl(problem)
    assert table is not None
    table.durations["total"] = round(time.monotonic() - start, 3)
    saved: dict[str, Any] = {"path": None, "error": None}
    if rank == 0:
        try:
            saved["path"] = cache.save(table)
        except Exception as exc:  # rank 0 only: its peers hear it in the next step
            saved["error"] = f"{type(exc).__name__}: {exc}"
    saved = agree("routes-saved", saved)[0]
    if saved["error"]:
        log(logging.WARNING, f"sglang_sm120: the quick tune's table could not be saved ({saved['error']}); "
                             "routing by it in this server only")
    return book(table, saved["path"] or "(not saved)")


__all__ = ["ALL_NCCL", "resolve_routes"]
