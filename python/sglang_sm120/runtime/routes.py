"""Which routing table a TP group routes by, decided once its workspace is built, in one agreement round (step 4 of
docs/overlay.md, "What happens at a launch"): every rank sends what it read under the key, and every rank takes the
same decision from the same list. Ranks only read tables; `python -m sglang_sm120.tune` writes them.
The ranks must run one kernel library and launch alike (ranks running different kernels would wait on each other
until the kernel timeout): a difference sends every size to NCCL whatever the setting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sgl_kernel_sm120.policy import KernelLimits, WorkspaceShape

from ..routing import cache
from ..routing.book import ALL_NCCL, SEEDS, TABLE, TUNE_COMMAND, RouteBook
from ..routing.table import KINDS, RoutingTable, make_key, route_differences

logger = logging.getLogger("sglang_sm120")


def resolve_routes(*, agree: Callable[[str, Any], list], keys: Sequence[Mapping[str, Any] | None],
                   islands, p2p, shape: WorkspaceShape, limits: KernelLimits, hidden: int, dtype: str,
                   max_bytes: int, tune: str, launch: Mapping[str, Any], log: Callable[[int, str], None]) -> RouteBook:
    """The group's routes (module docstring): the same RouteBook on every rank, from the agreed views and this
    rank's copy of the table they agreed on. Never raises: whatever goes wrong ends in NCCL for every size, with
    one WARNING (rank 0's, through `log`) naming the cause."""

    def all_nccl(why: str) -> RouteBook:
        log(logging.WARNING, f"sglang_sm120: {why}; every all-reduce of this group goes to NCCL (measure this box: "
                             f"{TUNE_COMMAND} --tp {len(keys)} --hidden {hidden})")
        return RouteBook(ALL_NCCL, why=why)

    loaded = None
    try:
        if any(k is None for k in keys):
            raise RuntimeError(f"ranks {[r for r, k in enumerate(keys) if k is None]} sent no key facts")
        key = make_key(list(keys), islands=islands, p2p=p2p, memory=shape.memory.value, launch=launch)
        loaded = cache.load(key, hidden=hidden, dtype=dtype)
        failure = cache.failure(key, hidden) if not loaded.ok else None
        local = {"launch": dict(launch), "kernels": sorted({k["kernels"] for k in keys}), "status": loaded.status,
                 "why": loaded.describe() + (f"; {cache.describe_failure(failure)}" if failure else ""),
                 "digest": loaded.table.digest() if loaded.ok else None, "blamed": cache.blames(key)}
    except Exception as exc:  # this rank's reason, named in the decision on every rank
        logger.warning("sglang_sm120: computing the routing-table key failed: %s: %s", type(exc).__name__, exc)
        local = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        views = agree("routes", local)
    except Exception as exc:
        return all_nccl(f"the ranks could not agree on their routes ({exc})")
    try:
        return _decide(views, loaded, shape, limits, dtype, max_bytes, tune, log, all_nccl)
    except Exception as exc:  # a malformed view or table the checks above did not foresee: the same on every rank
        return all_nccl(f"resolving the routes failed ({type(exc).__name__}: {exc})")


def _decide(views, loaded, shape, limits, dtype, max_bytes, tune, log, all_nccl) -> RouteBook:
    errors = [f"rank {r}: {v['error']}" for r, v in enumerate(views) if v.get("error")]
    if errors:
        why = f"the routing-table key could not be computed ({'; '.join(errors)})"
        return RouteBook(SEEDS, why=why, shape=shape, limits=limits) if tune == "off" else all_nccl(why)
    libraries = sorted({lib for v in views for lib in v["kernels"]})
    if len(libraries) > 1:
        return all_nccl(f"the ranks do not run the same kernel library ({', '.join(libraries)})")
    if any(v["launch"] != views[0]["launch"] for v in views):
        shown = "; ".join(f"rank {r} {v['launch']}" for r, v in enumerate(views))
        return all_nccl(f"the ranks' workspaces launch differently ({shown})")
    statuses = {v["status"] for v in views}
    if statuses == {cache.OK}:
        if len({v["digest"] for v in views}) > 1:
            return all_nccl("the ranks read different routing tables of this key (a table replaced while they "
                            "read it, or another tune writing it)")
        blamed = [dict(b) for b in {repr(sorted(b.items())): b for v in views for b in v["blamed"]}.values()]
        return _book(loaded.table, loaded.path, blamed, shape, limits, dtype, max_bytes, log)
    why = next(v["why"] for v in views if v["status"] != cache.OK) if len(statuses) == 1 else \
        f"the ranks read different routing tables ({sorted(statuses)})"
    if tune == "off":
        log(logging.INFO if views[0]["status"] == cache.MISSING else logging.WARNING,
            f"sglang_sm120: {why}; --sm120-allreduce-tune off: routes by the seeds, unmeasured")
        return RouteBook(SEEDS, why=why, shape=shape, limits=limits)
    return all_nccl(f"{why} (the launcher's tune gives one: see its lines in the launch log)")


def _book(table: RoutingTable, path: str, blamed, shape, limits, dtype, max_bytes, log) -> RouteBook:
    derived = table.rederived(blamed)
    differences = route_differences(table, derived)
    if differences:
        log(logging.WARNING, f"sglang_sm120: routing table {path}: its routes are not what its measurements give"
                             f"{' without the blamed candidates' if blamed else ''} ({differences}); routing by "
                             "the re-derived ones")
    short = [kind for kind in KINDS if derived.largest(dtype, kind) < max_bytes]
    if short:
        log(logging.WARNING, f"sglang_sm120: routing table {path} measured {dtype} {', '.join(short)} calls up to "
                             f"{min(derived.largest(dtype, k) for k in short)} B, this server's bound is {max_bytes} "
                             "B: larger calls go to NCCL (tune with this server's batch sizes to cover them)")
    return RouteBook(TABLE, table=derived, path=path, shape=shape, limits=limits, blamed=tuple(blamed))
