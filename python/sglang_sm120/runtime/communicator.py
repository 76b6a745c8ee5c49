"""The sm120 backend of one SGLang TP group: gate, workspace, dispatch rule and counters.

Life cycle (each step collective over the TP group, each bounded in time, each agreed by every rank):

1. `resolve_gate()`, from the `GroupCoordinator.__init__` seam: every rank publishes its facts, every rank
   evaluates the pure gate on the same list. Cheap; no GPU memory.
2. `build()`, from the pre-capture seam `ModelRunner._pre_initialize_flashinfer_allreduce_workspace`: the
   IpcAllReduce workspace is sized there because that is the first point where the model's hidden size,
   dtype and CUDA-graph batch sizes are all known, and it runs on every rank right before CUDA-graph capture
   (never inside it). Building lazily at GroupCoordinator init would have to guess the hidden size; building
   on first use could land inside a capture. Reductions before it (weight loading, profiling) use NCCL.
   The workspace lives where the gate said (`GateDecision.memory`): device memory reached over CUDA P2P, or
   pinned host memory when P2P is missing. A device build whose data-path probe fails on the ranks
   (`IpcAllReduceProbeError`: the driver allows P2P but peer writes or loads lose data) is retried once in host memory,
   unless SGLANG_SM120_HOSTMEM=off; the retry is decided from the agreed outcomes, so every rank takes it.
   Then the routes (runtime/route_resolution.py): the tuned table of this box, a quick tune at start-up, the
   seeds when the user asks for them, or NCCL for every size when no measured table can be used; every size goes
   to our kernels only where the table says they beat NCCL (`RouteBook`, routing/book.py).
3. `takes` / `takes_fused`: the one check of a call on its way in (the workspace takes the tensor, and the route
   book's route of its size and dtype), which answers the route to run or None (NCCL); `all_reduce` /
   `all_reduce_add_rmsnorm` launch that route without checking again, counted in `stats`.
4. `close()` from `GroupCoordinator.destroy`.

Any failure at 1 or 2 leaves every rank on SGLang's own path, with the reason logged.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from sgl_kernel_sm120.errors import IpcAllReduceHostMemoryError, IpcAllReduceProbeError
from sgl_kernel_sm120.policy import Route, describe_schedule

from ..core import exchange
from ..core.config import HOSTMEM_ENV, ByteBound, OverlaySettings
from ..core.facts import group_facts, launch_facts, local_facts
from ..core.gate import GateDecision, decide
from ..core.topology import kernel_islands, probe
from ..routing.book import ALL_NCCL, TABLE, RouteBook
from .route_resolution import resolve_routes

logger = logging.getLogger("sglang_sm120")

KERNEL_DTYPES = (torch.bfloat16, torch.float16)

TRANSPORTS = {"device": "CUDA IPC (P2P)", "host": "pinned host memory (no P2P)"}
# The activation line's state when the workspace is built but no measured table can be used.
ALL_NCCL_STATE = "ATTACHED, ALL SIZES ON NCCL"


def transport_text(memory: str | None) -> str:
    """How the activation line and the doctor name a workspace memory."""
    return TRANSPORTS.get(memory or "", f"unknown ({memory!r})")


def activation_line(enabled: bool, group: str, world_size: int, mode: str, detail: str, note: str = "",
                    state: str | None = None) -> str:
    """The one line (WARNING, rank 0) that says at server start whether the backend serves this TP group. It is
    a warning on purpose: launchers show SGLang's INFO lines only once its logging is set up, and a user must be
    able to see which all-reduce runs without raising the log level. `note`: what the hooks add about SGLang's
    own PCIe-IPC all-reduce (hooks/upstream_pcie.py, `activation_note`); empty when it was not asked for.
    `state` replaces ENABLED/DISABLED (a backend that is attached but routes every size to NCCL)."""
    state = state or ("ENABLED" if enabled else "DISABLED")
    tail = note or ("" if enabled else "; SGLang's own all-reduce paths are used")
    head = f"sglang_sm120: sm120 IPC all-reduce {state} for TP group {group} ({world_size} ranks, mode {mode})"
    return f"{head}: {detail}{tail}"


class Sm120Communicator:
    """Attached to a GroupCoordinator as `sm120_comm`. `stats` counts which path served each call:
    "sm120" (plain kernel), "sm120_fused" (fused kernel), "fallback" (SGLang's original all-reduce while the
    backend is active), "fused_fallback" (a fused call the kernel could not take: all-reduce + norm instead).
    Calls made while capturing a CUDA graph are counted once, at capture; replays run no Python."""

    def __init__(
        self,
        *,
        name: str,
        ranks: list[int],
        rank_in_group: int,
        world_size: int,
        cpu_group: Any,
        device: torch.device,
        settings: OverlaySettings,
        deterministic: bool,
        store: Any = None,
        group_coordinator: Any = None,
        upstream_note: Callable[[bool], str] | None = None,
    ):
        self.name = name
        self.ranks = list(ranks)
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.cpu_group = cpu_group
        self.device = device
        self.settings = settings  # the user's, parsed once (core/config.py)
        self.deterministic = deterministic
        self.store = store
        self._group_ref = weakref.ref(group_coordinator) if group_coordinator is not None else None
        # enabled -> what the activation line adds about SGLang's own PCIe-IPC all-reduce (given by the hooks).
        self.upstream_note = upstream_note or _no_note

        self.decision: GateDecision | None = None
        self.uuids: list[str | None] = []
        self.p2p: list[list[bool]] | None = None  # the gate's P2P matrix: part of the routing-table key
        # Which sizes go to our kernels, and how (set at build; none until then).
        self.routes: RouteBook = RouteBook.all_nccl("the workspace is not built yet")
        self.workspace = None  # sgl_kernel_sm120.IpcAllReduce once built
        self.build_attempted = False
        self.build_error: str | None = None
        self.max_bytes = 0
        self.max_fused_tokens = 0
        self.hidden_size: int | None = None
        self.dtype: torch.dtype | None = None
        self.bound_explanation = ""
        self.islands: list[list[int]] | None = None
        self.link: str | None = None
        # The workspace's memory: the gate's choice once it passed, then what was built ("device" | "host");
        # None while nothing is planned or after the build gave up.
        self.memory: str | None = None
        # Why the built memory differs from the gate's choice (the device build's probe failed), else "".
        self.memory_note = ""
        # Set by the pre-capture seam: True when the attention-TP and MoE groups are this very group, so a
        # fused call (which may name either) always reduces over the workspace's ranks.
        self.fusion_groups_ok = False
        self.stats = {"sm120": 0, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0}

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def for_group(
        cls, group, settings: OverlaySettings, deterministic: bool, *, store: Any = None,
        upstream_note: Callable[[bool], str] | None = None,
    ) -> Sm120Communicator:
        """The backend of a GroupCoordinator-like `group`; `store`: the c10d store the ranks agree over."""
        return cls(
            name=group.unique_name,
            ranks=list(group.ranks),
            rank_in_group=group.rank_in_group,
            world_size=group.world_size,
            cpu_group=group.cpu_group,
            device=group.device,
            settings=settings,
            deterministic=deterministic,
            store=store,
            group_coordinator=group,
            upstream_note=upstream_note,
        )

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def hostmem(self) -> str:
        """"auto" | "off": may a group without working P2P use host memory?"""
        return self.settings.hostmem

    @property
    def timeout_s(self) -> float:
        """The bound of every agreement of this backend."""
        return self.settings.agreement_timeout_s

    @property
    def group_coordinator(self):
        return self._group_ref() if self._group_ref is not None else None

    @property
    def gate_enabled(self) -> bool:
        return self.decision is not None and self.decision.enabled

    @property
    def active(self) -> bool:
        return self.workspace is not None

    def _scope(self, step: str) -> str:
        return f"{self.name}/{'-'.join(map(str, self.ranks))}/{step}"

    def _agree(self, step: str, payload: Any, timeout_s: float | None = None) -> list[Any]:
        prefix = exchange.next_prefix(self._scope(step), self.rank_in_group)
        return exchange.agree(self.store, prefix, self.rank_in_group, self.world_size, payload,
                              self.timeout_s if timeout_s is None else timeout_s)

    def _activation_line(self, enabled: bool, detail: str, state: str | None = None) -> str:
        return activation_line(enabled, self.name, self.world_size, self.mode, detail, self.upstream_note(enabled),
                               state)

    def _log_rank0(self, level: int, message: str, *args) -> None:
        if self.rank_in_group == 0:
            logger.log(level, message, *args)

    # ------------------------------------------------------------------------------------------------------
    def resolve_gate(self) -> GateDecision:
        """Collective: gather facts from every rank (bounded), decide. Never raises."""
        try:
            facts = local_facts(self.device, self.mode)
            if self.store is None:
                raise exchange.AgreementFailed("no c10d store to exchange facts over (torch.distributed not set up)")
            everyone = self._agree("gate", facts)
            gathered = group_facts(everyone)
            self.uuids = gathered.uuids
            self.p2p = gathered.p2p
            decision = decide(
                self.mode,
                gathered.capabilities,
                self.world_size,
                gathered.nnodes,
                gathered.p2p,
                self.deterministic,
                kernel_errors=gathered.kernel_errors,
                modes=gathered.modes,
                names=gathered.names,
                hostmem=self.hostmem,
            )
        except Exception as exc:
            decision = GateDecision(False, f"gate agreement failed, all-reduces stay on NCCL: {exc}")
            logger.warning("sglang_sm120 [%s rank %d]: %s", self.name, self.rank_in_group, decision.reason)
        self.decision = decision
        self.memory = decision.memory if decision.enabled else None
        if decision.enabled:
            # The ENABLED line waits for the workspace (built right before CUDA-graph capture): only then are the
            # byte bound and the schedule known, and only then is the backend really serving.
            self._log_rank0(
                logging.INFO,
                "sglang_sm120 [%s, %d ranks, mode=%s]: gate passed (%s); the IPC workspace is built before "
                "CUDA-graph capture", self.name, self.world_size, self.mode, decision.reason,
            )
        else:
            self._log_rank0(
                logging.WARNING, "%s", self._activation_line(False, decision.reason)
            )
        return decision

    # ------------------------------------------------------------------------------------------------------
    def build(
        self, hidden_size: int, dtype: torch.dtype, bound: ByteBound, kernel_timeout_s: float | None = None,
        tune: str = "off",
    ) -> bool:
        """Collective: create the IpcAllReduce workspace, then resolve the routes (`tune`: the
        --sm120-allreduce-tune setting; "off" keeps to an existing table or the seeds, the default here so that
        nothing measures unless the caller asks). Every rank ends with a workspace, or none does. Runs once;
        later calls (the draft model's runner) keep the first workspace, which captured graphs reference."""
        if not self.gate_enabled or self.build_attempted:
            return self.active
        self.build_attempted = True
        if dtype not in KERNEL_DTYPES:
            # The model dtype is the same on every rank, so every rank declines here without talking.
            return self._give_up(f"model dtype {dtype} is not supported by the kernel (bfloat16/float16 only)")
        element_size = torch.empty((), dtype=dtype).element_size()
        max_numel = bound.max_bytes // element_size // 8 * 8  # the kernel wants a multiple of 8 elements
        if max_numel < 8:
            return self._give_up(f"byte bound {bound.max_bytes} is below one 16-byte vector")

        memory = self.decision.memory
        # Rank 0 probes the topology once and everyone uses its answer, so islands and link agree. A host-memory
        # workspace has no islands and no link choice: every push goes through host memory.
        topo_payload: dict[str, Any] = {}
        if self.rank_in_group == 0 and memory == "device":
            topo = probe([u or "" for u in self.uuids])
            islands = topo.islands()
            topo_payload = {
                "islands": islands,
                "link": topo.link,
                "levels": topo.levels,
                "numa": topo.numa_nodes,
                "error": topo.error,
            }
        payload = {"max_numel": max_numel, "dtype": str(dtype), "hidden": int(hidden_size), "memory": memory,
                   "topology": topo_payload}
        try:
            everyone = self._agree("build", payload)
        except Exception as exc:
            return self._give_up(f"pre-build agreement failed: {exc}")
        keys = [(p["max_numel"], p["dtype"], p["hidden"], p["memory"]) for p in everyone]
        if len(set(keys)) != 1:
            return self._give_up(f"ranks disagree on (max_numel, dtype, hidden, memory): {keys}")
        topology = everyone[0]["topology"]
        self.islands = topology.get("islands")
        self.link = topology.get("link") or "auto"
        if topology.get("error"):
            self._log_rank0(logging.WARNING, "sglang_sm120 [%s]: topology probe: %s; using a flat schedule, link=%s",
                            self.name, topology["error"], self.link)

        comm, failed = self._construct("built", memory, max_numel, dtype, kernel_timeout_s)
        if failed and memory == "host" and _host_memory_failure(failed):
            return self._give_up(f"the pinned host-memory workspace does not fit: {_host_memory_failure(failed)}")
        if failed:
            detail = _failure_detail(failed)
            probe_failed = all(o.get("error_type") == IpcAllReduceProbeError.__name__ for o in failed.values())
            if memory != "device" or not probe_failed:
                return self._give_up(f"building the IPC workspace failed ({detail})")
            if self.hostmem == "off":
                return self._give_up(f"building the IPC workspace failed ({detail}); the pinned host-memory "
                                     f"workspace is not tried ({HOSTMEM_ENV}=off)")
            # Every rank saw the same agreed outcomes, so every rank retries here, once.
            pairs = _probe_pairs(failed)
            logger.info("sglang_sm120 [%s rank %d]: the P2P data-path probe failed (%s); retrying the workspace "
                        "in pinned host memory", self.name, self.rank_in_group, pairs)
            memory = "host"
            comm, failed_host = self._construct("built-host", memory, max_numel, dtype, kernel_timeout_s)
            if failed_host and _host_memory_failure(failed_host):
                return self._give_up(f"building the IPC workspace failed ({detail}); the retry in pinned host memory "
                                     f"does not fit: {_host_memory_failure(failed_host)}")
            if failed_host:
                return self._give_up(
                    f"building the IPC workspace failed ({detail}); the retry in pinned host memory failed too "
                    f"({_failure_detail(failed_host)})"
                )
            self.memory_note = f"the CUDA P2P data-path probe failed for {pairs}"
            self._log_rank0(
                logging.WARNING,
                "sglang_sm120 [%s]: the CUDA P2P data-path probe failed for %s; the pinned host-memory workspace "
                "(no P2P needed) is used instead (%s=off refuses it)", self.name, pairs, HOSTMEM_ENV,
            )

        self.memory = comm.shape.memory.value
        if self.memory == "host":
            self.islands = None
        self.link = comm.shape.link.value
        self.workspace = comm
        self.dtype = dtype
        self.hidden_size = int(hidden_size)
        self.max_bytes = max_numel * element_size
        self.max_fused_tokens = max_numel // int(hidden_size)
        self.bound_explanation = bound.explanation
        self.routes = self._resolve_routes(tune)
        state = ALL_NCCL_STATE if self.routes.source == ALL_NCCL else None
        self._log_rank0(logging.WARNING, "%s", self._activation_line(True, self.serving_summary(), state))
        return True

    def _resolve_routes(self, tune: str) -> RouteBook:
        """Collective (runtime/route_resolution.py): the table of this box, a quick tune, the seeds, or NCCL.
        Never raises."""
        ws = self.workspace
        return resolve_routes(
            agree=self._agree, rank=self.rank_in_group, world=self.world_size, device=self.device, shape=ws.shape,
            limits=ws.limits, islands=getattr(ws, "islands", None), p2p=self.p2p, hidden=int(self.hidden_size),
            dtype=self.dtype, max_bytes=self.max_bytes, tune=tune, tune_timeout_s=self.settings.tune_timeout_s,
            launch_facts=launch_facts(ws), log=lambda level, text: self._log_rank0(level, "%s", text),
        )

    def serving_summary(self) -> str:
        """What the built workspace serves, for the activation line: bound, schedule (the table's routes, or the
        seeds' variants), fused bound, islands, and where the routes come from."""
        comm = self.workspace
        link = comm.shape.link.value
        islands = getattr(comm, "islands", None)
        if self.routes.source == ALL_NCCL:
            return (f"attached, but every all-reduce goes to NCCL (SGLang's own path): {self.routes.source_line()}; "
                    f"transport built: {transport_text(self.memory)}; islands {islands or 'none (flat)'}, link "
                    f"{link}; gate: {self.decision.reason if self.decision else '?'}")
        if self.routes.source == TABLE:
            schedule = f"where the table routes them, {self.routes.describe(_dtype_name(self.dtype), self.max_bytes)}"
        else:
            schedule = describe_schedule(self.max_bytes, self.world_size, link, comm.shape.num_islands)
        transport = f"transport: {transport_text(self.memory)}"
        if self.memory_note:
            transport += f", because {self.memory_note}"
        waits = ""
        if getattr(comm, "timeout_s", None) is not None:
            waits = f"; a wait for a peer is logged after {comm.warn_after_s:g} s and fails after {comm.timeout_s:g} s"
        fused_launch = comm.describe_fused_launch() if hasattr(comm, "describe_fused_launch") else "?"
        return (
            f"all-reduces up to {self.max_bytes} B go to the sm120 kernels ({schedule}; fused all-reduce + "
            f"residual-add + RMSNorm up to {self.max_fused_tokens} tokens x {self.hidden_size}, a few rows "
            f"{fused_launch}), larger ones to NCCL; {transport}; islands {islands or 'none (flat)'}, "
            f"link {link}{waits}; "
            f"bound: {self.bound_explanation}; gate: {self.decision.reason if self.decision else '?'}; "
            f"{self.routes.source_line()}"
        )

    def _construct(
        self, step: str, memory: str, max_numel: int, dtype: torch.dtype, kernel_timeout_s: float | None
    ) -> tuple[Any, dict[int, dict[str, Any]]]:
        """Collective: one IpcAllReduce construction in `memory`, then an agreement on every rank's outcome.
        Returns (this rank's workspace or None, {rank: outcome} of the ranks that failed). On failure this rank's
        workspace, if it got one, is already closed (locally: the failed ranks hold none)."""
        comm, outcome = None, {"error": None}
        try:
            from sgl_kernel_sm120 import IpcAllReduce

            host = memory == "host"
            comm = IpcAllReduce(
                self.cpu_group,
                self.device,
                max_numel,
                dtype,
                islands=None if host else kernel_islands(self.islands, self.world_size),
                link="auto" if host else self.link,
                memory=memory,
                timeout_s=kernel_timeout_s,
            )
        except Exception as exc:  # IpcAllReduce raises on every rank together; the agreement below checks it
            outcome = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__}
            if isinstance(exc, IpcAllReduceHostMemoryError):
                outcome["error_type"] = IpcAllReduceHostMemoryError.__name__
            if isinstance(exc, IpcAllReduceProbeError):
                outcome["error_type"] = IpcAllReduceProbeError.__name__  # a subclass counts as the probe's
                outcome["pairs"] = [[int(s), int(r), str(what)] for s, r, what in getattr(exc, "pairs", [])]
        try:
            outcomes = self._agree(step, outcome)
            failed = {r: o for r, o in enumerate(outcomes) if o.get("error")}
        except Exception as exc:
            failed = {self.rank_in_group: {"error": f"post-build agreement failed: {exc}"}}
        if failed and comm is not None:
            _close_quietly(comm, collective=False)
            comm = None
        return comm, failed

    def _give_up(self, reason: str) -> bool:
        self.build_error = reason
        self.workspace = None
        self.memory = None
        # Every rank keeps its own view in its log; the user-facing verdict is one line, from rank 0.
        logger.info("sglang_sm120 [%s rank %d]: %s; all-reduces stay on NCCL", self.name, self.rank_in_group, reason)
        self._log_rank0(logging.WARNING, "%s", self._activation_line(False, reason))
        return False

    # ------------------------------------------------------------------------------------------------------
    # Dispatch: a pure function of shape, dtype, contiguity and configuration fixed at build time, so every rank of
    # the group takes the same path for the same call (a mismatch would leave a kernel waiting). A call is checked
    # once, here: the workspace takes the tensor (its device, dtype, contiguity and its bound, which is the byte
    # bound), and the route book's route for its size and dtype is one the workspace runs as measured (decided once
    # per size at build, routing/book.py). The launch that follows trusts both.
    def takes(self, inp: torch.Tensor) -> Route | None:
        """The route of ours for this plain all-reduce; None: SGLang's own path (NCCL)."""
        ws = self.workspace
        if ws is None or not ws.supports(inp):
            return None
        return self.routes.route(inp.numel() * inp.element_size(), _dtype_name(inp.dtype), False)

    def takes_fused(self, inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Route | None:
        """The route of ours for this fused all-reduce + residual-add + RMSNorm; None: all-reduce, then norm."""
        ws = self.workspace
        if ws is None or not ws.supports_add_rmsnorm(inp, residual, weight):
            return None
        return self.routes.route(inp.numel() * inp.element_size(), _dtype_name(inp.dtype), True)

    def fuses_rows(self, num_tokens: int) -> bool:
        """The fusion gate's question: are fused calls of `num_tokens` rows (of the model's hidden size and
        dtype) ours? Where the table routes them to NCCL, SGLang keeps its all-reduce + add + RMSNorm."""
        if self.workspace is None or self.hidden_size is None or not 0 < int(num_tokens) <= self.max_fused_tokens:
            return False
        element = torch.empty((), dtype=self.dtype).element_size() if self.dtype is not None else 2
        nbytes = int(num_tokens) * self.hidden_size * element
        return self.routes.route(nbytes, _dtype_name(self.dtype), True) is not None

    def all_reduce(self, inp: torch.Tensor, route: Route) -> torch.Tensor:
        """Runs `route`, which takes(inp) gave."""
        self.stats["sm120"] += 1
        return self.workspace.launch(route, inp)

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps: float, route: Route):
        """Runs `route`, which takes_fused(inp, residual, weight) gave."""
        self.stats["sm120_fused"] += 1
        return self.workspace.launch_fused(route, inp, residual, weight, eps)

    # ------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        comm, self.workspace = self.workspace, None
        if comm is not None:
            _close_quietly(comm, collective=True)

    def device_calls(self) -> int | None:
        """Calls the kernels completed, counted on the GPU (CUDA-graph replays included; the Python-side `stats`
        see a captured call once). None when there is no workspace or the read failed."""
        comm = self.workspace
        if comm is None:
            return None
        try:
            return int(comm.calls_completed())
        except Exception as exc:
            logger.debug("sglang_sm120: reading the device call counter failed: %s", exc)
            return None

    def describe(self) -> dict[str, Any]:
        return {
            "group": self.name,
            "mode": self.mode,
            "enabled": self.gate_enabled,
            "reason": self.decision.reason if self.decision else None,
            "active": self.active,
            "build_error": self.build_error,
            "max_bytes": self.max_bytes,
            "max_fused_tokens": self.max_fused_tokens,
            "islands": self.islands,
            "link": self.link,
            "memory": self.memory,  # "device" (CUDA IPC over P2P) | "host" (pinned host memory) | None
            "memory_note": self.memory_note,
            "fused_clusters": dict(self.workspace.fused_clusters) if self.workspace is not None else None,
            "routes": self.routes.as_dict(_dtype_name(self.dtype) if self.dtype else None, self.max_bytes),
            "stats": dict(self.stats),
            "device_calls": self.device_calls(),
        }


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _host_memory_failure(failed: dict[int, dict[str, Any]]) -> str:
    """The kernel's own sentence ("host memory: /dev/shm has X free, the workspace needs Y ...; enlarge it ...")
    when the host-memory workspace did not fit its tmpfs, else ""."""
    for outcome in failed.values():
        text = str(outcome.get("error", ""))
        if outcome.get("error_type") == IpcAllReduceHostMemoryError.__name__ and "host memory:" in text:
            sentence = text[text.index("host memory:"):].splitlines()[0]
            return sentence.rstrip(")").strip()
    return ""


def _no_note(enabled: bool) -> str:
    return ""


def _failure_detail(failed: dict[int, dict[str, Any]]) -> str:
    return "; ".join(f"rank {r}: {o['error']}" for r, o in sorted(failed.items()))


def _probe_pairs(failed: dict[int, dict[str, Any]]) -> str:
    """'rank 1 -> rank 0 (dropped), ...' from the probe errors the ranks reported (the same table on each)."""
    pairs: list[tuple[int, int, str]] = []
    for outcome in failed.values():
        for sender, receiver, what in outcome.get("pairs") or []:
            if (sender, receiver, what) not in pairs:
                pairs.append((sender, receiver, what))
    if not pairs:
        return "some pairs (the probe error named none)"
    shown = ", ".join(f"rank {s} -> rank {r} ({what})" for s, r, what in pairs[:16])
    return shown + (f" (+{len(pairs) - 16} more)" if len(pairs) > 16 else "")


# At shutdown every TP rank destroys its groups at the same point; a rank that does not (it died) must not
# hold the others for long.
SHUTDOWN_CLOSE_BARRIER_S = 10.0


def _close_quietly(comm, *, collective: bool) -> None:
    """IpcAllReduce.close() synchronizes the device first (no launched kernel may still use the mappings) and,
    when collective, frees its slab only once every rank has unmapped it."""
    try:
        comm.close(collective=collective, barrier_timeout_s=SHUTDOWN_CLOSE_BARRIER_S)
    except Exception as exc:
        logger.warning("sglang_sm120: closing the IPC workspace failed: %s", exc)
