"""The sm120 backend of one SGLang TP group: its gate decision, workspace, routes and counters.

Every step is collective over the group, bounded in time and agreed over the c10d store (core/exchange.py), in the
order of docs/overlay.md ("What happens at a launch"): a rank's start-up makes at most four agreement rounds (gate,
workspace, a host-memory retry, routes). Any failure leaves every rank on SGLang's own path, with the reason logged.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from sgl_kernel_sm120.policy import DTYPES, ELEMENT_BYTES, describe_schedule

from ..core import exchange, plan
from ..core.config import HOSTMEM_ENV, ByteBound, OverlaySettings
from ..core.facts import group_facts, launch_facts, local_facts
from ..core.gate import GateDecision, decide
from ..core.topology import probe
from ..routing.book import ALL_NCCL, TABLE, RouteBook
from .routes import resolve_routes

logger = logging.getLogger("sglang_sm120")

MEMORY_WORDS = {"device": "CUDA IPC (P2P)", "host": "pinned host memory (no P2P)"}
UPSTREAM_PATHS = "; SGLang's own all-reduce paths are used"
DTYPE_NAMES = {getattr(torch, name): name for name in DTYPES}
# At shutdown every rank destroys its groups at once; a rank that died must not hold the others for long.
SHUTDOWN_CLOSE_BARRIER_S = 10.0
_UNSEEN = object()


def activation_line(enabled: bool, group: str, world_size: int, mode: str, detail: str, note: str = "",
                    state: str | None = None) -> str:
    """Rank 0's one WARNING line saying whether the backend serves this TP group (a warning so that it shows
    before SGLang's logging is set up). `note`: what the hooks add about SGLang's own PCIe-IPC all-reduce."""
    head = (f"sglang_sm120: sm120 IPC all-reduce {state or ('ENABLED' if enabled else 'DISABLED')} for TP group "
            f"{group} ({world_size} ranks, mode {mode})")
    return f"{head}: {detail}{note or ('' if enabled else UPSTREAM_PATHS)}"


class TPBackend:
    """Attached to a GroupCoordinator (runtime/registry.py). `stats` counts which path served each call: "sm120"
    (plain kernel), "sm120_fused", "fallback" (SGLang's all-reduce while the backend is active), "fused_fallback"
    (a fused call the kernel could not take: all-reduce + norm). A call captured in a CUDA graph counts once."""

    def __init__(self, *, name: str, ranks: list[int], rank_in_group: int, world_size: int, device: torch.device,
                 settings: OverlaySettings, deterministic: bool, store: Any = None, group: Any = None,
                 upstream_note: Callable[[bool], str] | None = None):
        self.name, self.ranks, self.rank_in_group, self.world_size = name, list(ranks), rank_in_group, world_size
        self.device, self.settings, self.deterministic, self.store = device, settings, deterministic, store
        self._group = weakref.ref(group) if group is not None else (lambda: None)
        self._scope = f"{name}/{'-'.join(map(str, ranks))}"
        self.upstream_note = upstream_note or (lambda enabled: "")
        self.decision: GateDecision | None = None
        self.facts = None  # core.facts.GroupFacts of the gate round
        self.routes = RouteBook(ALL_NCCL, why="the workspace is not built yet")
        self.workspace = None  # sgl_kernel_sm120.IpcAllReduce once built
        self.build_attempted, self.build_error = False, None
        self.hidden_size = self.dtype = self.islands = self.link = None  # what build() found
        self.max_bytes = self.max_fused_tokens = 0
        self.memory: str | None = None  # the gate's choice, then what was built; None when nothing is
        self.memory_note = ""  # why the built memory differs from the gate's choice
        self.fused_tokens: frozenset[int] = frozenset()
        self.rounds = 0  # agreement rounds made (tests count them)
        self._plain, self._fused = {}, {}  # routes memoized by (numel, dtype) and (rows, hidden, dtype)
        self.stats = {"sm120": 0, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0}

    @classmethod
    def for_group(cls, group, settings: OverlaySettings, deterministic: bool, *, store: Any = None,
                  upstream_note: Callable[[bool], str] | None = None) -> TPBackend:
        return cls(name=group.unique_name, ranks=list(group.ranks), rank_in_group=group.rank_in_group,
                   world_size=group.world_size, device=group.device, settings=settings,
                   deterministic=deterministic, store=store, group=group, upstream_note=upstream_note)

    @property
    def group_coordinator(self):
        return self._group()

    @property
    def gate_enabled(self) -> bool:
        return self.decision is not None and self.decision.enabled

    @property
    def active(self) -> bool:
        return self.workspace is not None

    def _agree(self, step: str, payload: Any) -> list[Any]:
        self.rounds += 1
        prefix = exchange.next_prefix(f"{self._scope}/{step}", self.rank_in_group)
        return exchange.agree(self.store, prefix, self.rank_in_group, self.world_size, payload,
                              self.settings.agreement_timeout_s)

    def _log_rank0(self, level: int, text: str) -> None:
        if self.rank_in_group == 0:
            logger.log(level, "%s", text)

    def _line(self, enabled: bool, detail: str, state: str | None = None) -> str:
        return activation_line(enabled, self.name, self.world_size, self.settings.mode, detail,
                               self.upstream_note(enabled), state)

    def resolve_gate(self) -> GateDecision:
        """Collective: every rank's facts, the same decision everywhere. Never raises."""
        try:
            if self.store is None:
                raise exchange.AgreementFailed("no c10d store to agree over (torch.distributed is not set up)")
            mode = self.settings.mode
            f = self.facts = group_facts(self._agree("gate", local_facts(self.device, mode)))
            decision = decide(mode, f.capabilities, self.world_size, f.nnodes, f.p2p, self.deterministic,
                              kernel_errors=f.kernel_errors, modes=f.modes, names=f.names,
                              hostmem=self.settings.hostmem)
        except Exception as exc:
            decision = GateDecision(False, f"gate agreement failed, all-reduces stay on NCCL: {exc}")
            logger.warning("sglang_sm120 [%s rank %d]: %s", self.name, self.rank_in_group, decision.reason)
        self.decision = decision
        self.memory = decision.memory if decision.enabled else None
        if decision.enabled:  # the ENABLED line waits for the workspace: only then is it serving
            self._log_rank0(logging.INFO, f"sglang_sm120 [{self.name}]: gate passed ({decision.reason}); the IPC "
                                          "workspace is built before CUDA-graph capture")
        else:
            self._log_rank0(logging.WARNING, self._line(False, decision.reason))
        return decision

    def build(self, hidden_size: int, dtype: torch.dtype, bound: ByteBound, *, kernel_timeout_s: float | None = None,
              tune: str = "off", fusion_ok: bool = True, verify_rows: int = 1) -> bool:
        """Collective: the workspace, then its routes. Every rank ends with a workspace or none does. Runs once:
        the first workspace stays (captured graphs reference it). `fusion_ok`: fused calls reduce over this
        group (the attention-TP and MoE groups are it, no DP attention)."""
        if not self.gate_enabled or self.build_attempted:
            return self.active
        self.build_attempted = True
        if dtype not in DTYPE_NAMES:  # the same on every rank: all decline without talking
            return self._give_up(f"model dtype {dtype} is not supported by the kernel (bfloat16/float16 only)")
        max_numel = bound.max_bytes // ELEMENT_BYTES
        topology = None
        if self.decision.memory == "device":
            # Every rank probes the same NVML tree, and the workspace's own argument check compares the islands.
            topology = probe([u or "" for u in self.facts.uuids])
            if topology.error:
                self._log_rank0(logging.WARNING, f"sglang_sm120 [{self.name}]: topology probe: {topology.error}; a "
                                                 f"flat schedule, link {topology.link}")
        try:
            first = plan.plan(self.facts.p2p, self.settings.hostmem, topology)
        except plan.PlanRefused as exc:
            return self._give_up(str(exc))
        built = plan.build(first, lambda p: self._construct(p, max_numel, dtype, kernel_timeout_s),
                           self.settings.hostmem)
        if built.workspace is None:
            return self._give_up(built.failure)
        if built.note:
            self.memory_note = built.note
            self._log_rank0(logging.WARNING, f"sglang_sm120 [{self.name}]: {built.note}; the pinned host-memory "
                                             f"workspace (no P2P needed) is used instead ({HOSTMEM_ENV}=off refuses "
                                             "it)")
        workspace = built.workspace
        self.workspace, self.memory, self.link = workspace, workspace.shape.memory.value, workspace.shape.link.value
        self.islands = built.plan.islands if self.memory == "device" else None
        self.dtype, self.hidden_size, self.max_bytes = dtype, int(hidden_size), max_numel * ELEMENT_BYTES
        self.max_fused_tokens = max_numel // self.hidden_size
        self.routes = resolve_routes(
            agree=self._agree, keys=self.facts.keys, islands=workspace.islands, p2p=self.facts.p2p,
            shape=workspace.shape, limits=workspace.limits, hidden=self.hidden_size, dtype=DTYPE_NAMES[dtype],
            max_bytes=self.max_bytes, tune=tune, launch=launch_facts(workspace),
            log=lambda level, text: self._log_rank0(level, text))
        if self.routes.source == ALL_NCCL:
            # Nothing of ours serves: the workspace goes, SGLang's own paths (0.5.23's PCIe all-reduce too) stay.
            self.close()
            return self._give_up(self.routes.source_line(), state="ALL SIZES ON NCCL")
        if fusion_ok:
            self.fused_tokens = frozenset(t for t in range(1, self.max_fused_tokens + 1) if workspace.admits_fused(
                t, self.hidden_size, dtype) and self._fused_route(t, self.hidden_size, dtype) is not None)
        self._log_rank0(logging.WARNING, self._line(True, self._summary(bound, max(1, int(verify_rows)))))
        return True

    def _construct(self, chosen: plan.Plan, max_numel: int, dtype, kernel_timeout_s):
        """One construction, then an agreement on every rank's outcome: (workspace or None, {rank: outcome} of the
        ranks that failed). A rank's workspace is closed again when any rank failed."""
        workspace, outcome = None, {"error": None}
        step = "workspace" if chosen.memory == "device" else "workspace-host"
        try:
            from sgl_kernel_sm120 import IpcAllReduce

            workspace = IpcAllReduce(
                exchange.StoreExchange(self.store, f"{self._scope}/{step}", self.rank_in_group, self.world_size,
                                       self.settings.agreement_timeout_s),
                self.device, max_numel, dtype, memory=chosen.memory, timeout_s=kernel_timeout_s,
                islands=chosen.islands, link=chosen.link)
        except Exception as exc:  # the construction raises on every rank together; agreed below
            outcome = plan.failure_of(exc)
        try:
            failed = {r: o for r, o in enumerate(self._agree(step, outcome)) if o.get("error")}
        except Exception as exc:
            failed = {self.rank_in_group: {"error": f"the outcome agreement failed: {exc}"}}
        if failed and workspace is not None:
            _close_quietly(workspace, collective=False)
            workspace = None
        return workspace, failed

    def _give_up(self, reason: str, state: str | None = None) -> bool:
        self.build_error, self.workspace, self.memory = reason, None, None
        logger.info("sglang_sm120 [%s rank %d]: %s; all-reduces stay on NCCL", self.name, self.rank_in_group, reason)
        self._log_rank0(logging.WARNING, self._line(False, reason, state))
        return False

    # Dispatch. A pure function of the call's shape, dtype and layout and of what was agreed at build, so every
    # rank takes the same path (a mismatch would leave a kernel waiting for its peer).
    def route_for(self, inp: torch.Tensor):
        """The route of ours for this plain all-reduce, or None (SGLang's own path). Sizes above the bound are
        answered before the memo, which so holds one entry per size and dtype within it."""
        ws = self.workspace
        if ws is None or inp.device != self.device or not inp.is_contiguous():
            return None
        numel = inp.numel()
        if numel > ws.max_numel:
            return None
        route = self._plain.get((numel, inp.dtype), _UNSEEN)
        if route is _UNSEEN:
            route = self._plain[numel, inp.dtype] = self.routes.route(
                numel * ELEMENT_BYTES, DTYPE_NAMES[inp.dtype], False) if ws.supports(inp) else None
        return route

    def _fused_route(self, rows: int, hidden: int, dtype: torch.dtype):
        """The route of a fused call of a size the workspace admits (its callers ask it first), memoized."""
        route = self._fused[rows, hidden, dtype] = self.routes.route(rows * hidden * ELEMENT_BYTES, DTYPE_NAMES[dtype],
                                                                     True)
        return route

    def fused_route_for(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        """The route of ours for this fused all-reduce + residual-add + RMSNorm, or None (all-reduce, then norm)."""
        ws = self.workspace
        if ws is None or not ws.supports_add_rmsnorm(x, residual, weight):
            return None
        rows, hidden = x.shape
        route = self._fused.get((rows, hidden, x.dtype), _UNSEEN)
        return self._fused_route(rows, hidden, x.dtype) if route is _UNSEEN else route

    def run(self, inp: torch.Tensor, route) -> torch.Tensor:
        self.stats["sm120"] += 1
        return self.workspace.launch(route, inp)

    def run_fused(self, x, residual, weight, eps: float, route):
        self.stats["sm120_fused"] += 1
        return self.workspace.launch_fused(route, x, residual, weight, eps)

    def _summary(self, bound: ByteBound, verify_rows: int) -> str:
        """What the built workspace serves, for the activation line."""
        ws, gate = self.workspace, self.decision.reason
        place = (f"transport: {MEMORY_WORDS.get(self.memory, self.memory)}"
                 + (f", because {self.memory_note}" if self.memory_note else "")
                 + f"; islands {self.islands or 'none (flat)'}, link {self.link}")
        dtype = DTYPE_NAMES[self.dtype]
        if self.routes.source == TABLE:
            schedule = f"where the table routes them, {self.routes.describe(dtype, self.max_bytes)}"
        else:
            schedule = describe_schedule(self.max_bytes, self.world_size, ws.shape.link, ws.shape.num_islands)
        return (f"all-reduces up to {self.max_bytes} B go to the sm120 kernels ({schedule}; fused all-reduce + "
                f"residual-add + RMSNorm up to {self.max_fused_tokens} tokens x {self.hidden_size}, a few rows "
                f"{ws.describe_fused_launch()}), larger ones to NCCL{self._versus_nccl(verify_rows)}; {place}; a wait "
                f"for a peer is logged after {ws.warn_after_s:g} s and fails after {ws.timeout_s:g} s; bound: "
                f"{bound.explanation}; gate: {gate}; {self.routes.source_line()}")

    def _versus_nccl(self, rows: int) -> str:
        """For a table: ours against NCCL at the verify size, as measured."""
        if self.routes.source != TABLE:
            return ""
        dtype, parts = DTYPE_NAMES[self.dtype], []
        for kind in ("fused", "plain"):
            route, ours, nccl = self.routes.table.versus_nccl(dtype, kind, rows)
            if nccl is None:
                parts.append(f"{kind}: not measured")
            elif ours is None:
                parts.append(f"{kind}: NCCL {nccl:.1f} us (faster than ours there)")
            else:
                parts.append(f"{kind}: ours {ours:.1f} us ({route.id}) against NCCL {nccl:.1f} us")
        return f"; at the verify size [{rows}, {self.hidden_size}] {dtype}: {', '.join(parts)}"

    def close(self) -> None:
        workspace, self.workspace = self.workspace, None
        self.fused_tokens, self._plain, self._fused = frozenset(), {}, {}
        if workspace is not None:
            _close_quietly(workspace, collective=True)

    def device_calls(self) -> int | None:
        """Calls the kernels completed, counted on the GPU (graph replays included); None without a workspace."""
        try:
            return int(self.workspace.calls_completed()) if self.workspace is not None else None
        except Exception as exc:
            logger.debug("sglang_sm120: reading the device call counter failed: %s", exc)
            return None

    def describe(self) -> dict[str, Any]:
        return {"group": self.name, "mode": self.settings.mode, "enabled": self.gate_enabled,
                "reason": self.build_error or (self.decision.reason if self.decision else None), "active": self.active,
                "build_error": self.build_error, "max_bytes": self.max_bytes,
                "max_fused_tokens": self.max_fused_tokens, "islands": self.islands, "link": self.link,
                "memory": self.memory, "memory_note": self.memory_note,
                "fused_clusters": dict(self.workspace.fused_clusters) if self.workspace is not None else None,
                "routes": self.routes.as_dict(DTYPE_NAMES.get(self.dtype), self.max_bytes),
                "stats": dict(self.stats), "device_calls": self.device_calls()}


def _close_quietly(workspace, *, collective: bool) -> None:
    try:
        workspace.close(collective=collective, barrier_timeout_s=SHUTDOWN_CLOSE_BARRIER_S)
    except Exception as exc:
        logger.warning("sglang_sm120: closing the IPC workspace failed: %s", exc)
