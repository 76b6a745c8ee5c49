"""SGLang-level GPU tests: the overlay inside SGLang's real distributed layer, for either supported release.

Each test runs its ranks as spawned processes through tests/gpu/harness.py (`run_ranks`: a gloo group among them,
a bounded run, a verdict gathered from every rank). Inside a rank, `start()` does what a scheduler process does
before loading a model: stand-ins for the GPU-only packages SGLang imports (sgl_kernel, flashinfer; see
benchmarks/harness/standins.py), the overlay activated, the server arguments set (0.5.13.post1: the
global record; 0.5.23: published in the runtime context, which sizes the groups), SGLang's own
`init_distributed_environment` + `initialize_model_parallel`.

Two modes, chosen by `plan()`:
- one GPU per rank (2 GPUs for 2 ranks): SGLang's groups on NCCL, as in a server;
- SHARED (SGL_SM120_TEST_SHARE_GPUS=1, or automatically when there are fewer GPUs than ranks): ranks share the
  GPUs (rank r on GPU r % count), SGLang's distributed layer on gloo. NCCL refuses two ranks on one GPU; gloo
  all-reduces CUDA tensors, so SGLang's own path (the fallback of our dispatch) still sums, eagerly. Our kernels
  need only CUDA IPC between the ranks' processes, which works on one GPU. A gloo reduction cannot be captured
  in a CUDA graph, so in this mode graphs hold only calls our kernels serve. Correctness only: no timing from
  this mode means anything.

PATCHES (shared mode only; applied here, in the test harness, never in the overlay, and logged by every rank):
- `parallel_state.init_model_parallel_group` is wrapped so every group SGLang builds gets `use_pynccl=False`
  (pynccl opens an NCCL communicator, which refuses two ranks on one GPU), and no custom all-reduce, mscclpp or
  torch symmetric-memory communicator (IPC/NVLS set-ups that assume one GPU per rank). `initialize_model_parallel`
  looks the function up as a module global in both releases, so the wrapper is what it calls.
- `parallel_state.set_custom_all_reduce(False)`: SGLang's own switch (`--disable-custom-all-reduce`).
PATCH where sgl_kernel is missing (any mode; `patch_weak_ref_tensor`, for 0.5.23's breakable CUDA graphs):
- `runner_backend_utils.weak_ref_tensor.weak_ref_tensor` (sgl_kernel's non-owning view, which an eager break
  applies to the tensors it reads) hands back the tensor itself: the same storage and data, only held longer
  (the graph pool cannot reuse that memory meanwhile). Replays read the same bytes either way.
Nothing else of SGLang is changed. Tests that need SGLang code a GPU machine cannot import (models.deepseek_v2
needs sgl_kernel's torch ops) take that one function from SGLang's source with `upstream_function()`, which
says so in its log line too.

CPU DRY RUN (SGL_SM120_TEST_DRY_RUN=1; a developer check on a machine without GPUs, never selected by the GPU
suite): ranks on the CPU over gloo, SGLang's groups on the CPU, the sm120 backend attached to the TP group by
hand (the overlay declines non-CUDA groups) with a gloo-backed stand-in for IpcAllReduce (exact fp32 sums, the
reference add + RMSNorm). It exercises the test logic against SGLang's real code; what needs CUDA (graphs,
the kernels themselves) is left out there and runs on the GPU machine.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tests.gpu.harness import SHARE_GPUS_ENV, gpu_count, run_ranks

DRY_RUN_ENV = "SGL_SM120_TEST_DRY_RUN"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
logger = logging.getLogger("sglang_sm120.tests.sglang_harness")


def dry_run() -> bool:
    return os.environ.get(DRY_RUN_ENV) == "1"


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def skip_reason(world: int) -> str | None:
    """Why an SGLang-level test of `world` ranks cannot run here, or None."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (on the GPU machine: the .sgl carry, see scripts/pack_sglang_gpu.py)"
    if dry_run():
        return None
    if gpu_count() < 1:
        return "needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)"
    return None


def needs(world: int):
    """skipif for an SGLang-level test of `world` ranks: sglang installed and at least one GPU."""
    import pytest

    return pytest.mark.skipif(skip_reason(world) is not None, reason=skip_reason(world) or "")


@dataclass(frozen=True)
class Plan:
    world: int
    shared: bool  # ranks share GPUs; SGLang's groups on gloo
    backend: str  # what SGLang's groups use: "nccl" or "gloo"
    dry_run: bool = False
    cache_root: str = ""  # each rank's SGLANG_SM120_CACHE is a folder in it; run() removes it when the ranks ended

    def describe(self) -> str:
        if self.dry_run:
            return f"{self.world} ranks, CPU dry run (gloo, stand-in kernels)"
        if self.shared:
            return (f"{self.world} ranks sharing {gpu_count()} GPU(s); SGLang's groups on gloo, pynccl and SGLang's "
                    "custom all-reduces off (harness patches)")
        return f"{self.world} ranks, one GPU each; SGLang's groups on NCCL"


def plan(world: int) -> Plan:
    """One GPU per rank when there are enough and SGL_SM120_TEST_SHARE_GPUS is not 1, else shared (gloo)."""
    if dry_run():
        return Plan(world, shared=True, backend="gloo", dry_run=True)
    shared = os.environ.get(SHARE_GPUS_ENV) == "1" or gpu_count() < world
    return Plan(world, shared=shared, backend="gloo" if shared else "nccl")


def run(world: int, fn, *args, timeout_s: float = 300.0) -> None:
    """Run fn(ctx, *args) on `world` ranks, ctx being this module's `Rank` (built by the worker with `start`).

    fn must be module level (it is pickled for spawn). The plan is made here, in the parent, so every rank
    runs in the same mode."""
    with tempfile.TemporaryDirectory(prefix="sgl_sm120_cache_") as cache_root:
        run_ranks(world, _entry, dataclasses.replace(plan(world), cache_root=cache_root), fn, args,
                  timeout_s=timeout_s)


def _entry(rank: int, world: int, the_plan: Plan, fn, args) -> None:
    fn(rank, world, the_plan, *args)


# ---------------------------------------------------------------------------------------------------------
# inside a rank


@dataclass
class Rank:
    rank: int
    world: int
    plan: Plan
    version: str
    device: Any  # torch.device
    ps: Any  # sglang.srt.distributed.parallel_state
    tp: Any  # the TP GroupCoordinator
    comm: Any  # the sm120 communicator attached to it (None when the gate said no)
    cpu_group: Any  # the world's gloo group, for the tests' own agreements
    patches: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)  # INFO+ lines of the "sglang_sm120" logger

    @property
    def is_0523(self) -> bool:
        return self.version == "0.5.23"

    def finish(self) -> None:
        """Destroy the model-parallel groups (the overlay's destroy seam closes the workspace). The world group
        and the default process group stay: the harness gathers its verdict over them."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ps.destroy_model_parallel()


class _Collect(logging.Handler):
    def __init__(self, lines):
        super().__init__(level=logging.INFO)
        self.lines = lines

    def emit(self, record):
        self.lines.append(record.getMessage())


def _say(rank: int, text: str) -> None:
    print(f"[sglang-harness rank {rank}] {text}", file=sys.stderr, flush=True)


def patch_groups_for_shared_gpus(ps, rank: int, log: bool = True) -> list[str]:
    """The shared-mode patches (see the module docstring). Returns one line per patch applied (logged unless
    `log` is false: a caller with its own log says them itself)."""
    import functools
    import inspect

    applied = []
    original = ps.init_model_parallel_group
    if not getattr(original, "_sm120_harness", False):
        names = set(inspect.signature(original).parameters)
        forced = {k: False for k in ("use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_mscclpp_allreduce",
                                     "use_torch_symm_mem_allreduce") if k in names}

        @functools.wraps(original)
        def init_model_parallel_group(*args, **kwargs):
            kwargs.update(forced)
            return original(*args, **kwargs)

        init_model_parallel_group._sm120_harness = True
        ps.init_model_parallel_group = init_model_parallel_group
        applied.append("parallel_state.init_model_parallel_group: " + ", ".join(f"{k}=False" for k in forced))
    ps.set_custom_all_reduce(False)
    applied.append("parallel_state.set_custom_all_reduce(False)")
    if log:
        for line in applied:
            _say(rank, f"harness patch (shared GPUs, not the overlay): {line}")
    return applied


def _strong_ref(tensor):
    return tensor


def patch_weak_ref_tensor(rank: int) -> list[str]:
    """Stand-ins for what is missing (sgl_kernel, flashinfer), and, where sgl_kernel is one, the weak_ref_tensor
    patch of the module docstring. Returns one line per patch applied (also logged)."""
    for path in (os.path.join(REPO, "python"), REPO):
        if path not in sys.path:
            sys.path.insert(0, path)
    from benchmarks.harness import standins

    standins.install()
    if "sgl_kernel" not in standins.installed_roots():
        return []
    from sglang.srt.model_executor.runner_backend_utils import weak_ref_tensor as module

    module.weak_ref_tensor = _strong_ref
    line = ("runner_backend_utils.weak_ref_tensor.weak_ref_tensor: sgl_kernel is missing here, the tensor itself "
            "is handed back (same data, held longer)")
    _say(rank, f"harness patch (not the overlay): {line}")
    return [line]


def _publish_server_args(version: str, rank: int, world: int, local_rank: int, device_type: str,
                         fields: dict) -> Any:
    """What a scheduler has before it builds groups: 0.5.23 publishes the resolved record (it sizes the groups
    from it); 0.5.13.post1 sets the global record."""
    from sglang.srt.server_args import ServerArgs

    if version == "0.5.23":
        from sglang.srt.runtime_context import SpawnRanks, publish

        server_args = ServerArgs(model_path="dummy", tp_size=world, device=device_type, **fields)
        server_args.resolve_once()
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=local_rank))
        return server_args
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    server_args = ServerArgs(model_path="dummy", tp_size=world, device=device_type)
    for key, value in fields.items():
        setattr(server_args, key, value)
    set_global_server_args_for_scheduler(server_args)
    return server_args


def start(rank: int, world: int, the_plan: Plan, *, mode: str = "on", env: dict | None = None,
          server_args_0513: dict | None = None, server_args_0523: dict | None = None) -> Rank:
    """Bring this rank up the way a scheduler does, with the overlay active (SGLANG_SM120_ALLREDUCE=`mode`)."""
    os.environ["SGLANG_SM120_ALLREDUCE"] = mode
    os.environ.pop("SGLANG_SM120_ALLREDUCE_MAX_BYTES", None)
    # Routes by the seeds, from a cache of this test alone. The start-up tune (the default, auto) would measure
    # this harness: on ranks sharing a GPU that is time-slicing against gloo in NCCL's place, and such a run
    # routes small all-reduces to "NCCL" (gloo, in place). These tests check the overlay's
    # paths, not the tune's verdict (tests/gpu/test_tune_gpu.py does); a test may still set both through `env`.
    os.environ["SGLANG_SM120_ALLREDUCE_TUNE"] = "off"
    os.environ["SGLANG_SM120_CACHE"] = os.path.join(the_plan.cache_root, f"rank{rank}")
    from tests.support.env import spelled_out

    for key, value in (env or {}).items():
        os.environ.update(spelled_out(key, value))  # an SGL_ switch under both names: SGLang 0.5.23 copies them
    for path in (os.path.join(REPO, "python"), REPO):
        if path not in sys.path:
            sys.path.insert(0, path)
    from benchmarks.harness import standins

    covered = standins.install()  # only for whichever of sgl_kernel / flashinfer is missing
    import torch
    import torch.distributed as dist

    version = sglang_version()
    if version not in ("0.5.23", "0.5.13.post1"):
        raise RuntimeError(f"no SGLang-level GPU test for sglang {version}")
    if the_plan.dry_run:
        device, local_rank = torch.device("cpu"), rank
    else:
        local_rank = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    log_lines: list[str] = []
    overlay_logger = logging.getLogger("sglang_sm120")
    overlay_logger.addHandler(_Collect(log_lines))
    overlay_logger.setLevel(logging.INFO)

    import sglang_sm120

    sglang_sm120.activate()
    from sglang.srt.distributed import parallel_state as ps

    patches = []
    if covered:
        patches.append(f"stand-ins for {', '.join(covered)} (not installed here)")
    if the_plan.shared:
        patches += patch_groups_for_shared_gpus(ps, rank)
    fields = (server_args_0523 if version == "0.5.23" else server_args_0513) or {}
    _publish_server_args(version, rank, world, local_rank, device.type, fields)
    if the_plan.dry_run:
        _install_dry_run_kernel()
    ps.init_distributed_environment(
        world_size=world, rank=rank, local_rank=local_rank, backend=the_plan.backend,
        distributed_init_method="env://",  # unused: the harness's default process group exists already
    )
    if version == "0.5.23":
        ps.initialize_model_parallel()
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        # what 0.5.13.post1's ModelRunner does right after (LayerCommunicator reads the attention-DP sizes)
        from sglang.srt.layers.dp_attention import initialize_dp_attention
        from sglang.srt.server_args import get_global_server_args

        initialize_dp_attention(get_global_server_args(),
                                SimpleNamespace(hidden_size=1, dtype=torch.bfloat16))
    from sglang_sm120.hooks.distributed import sglang_group

    tp = sglang_group("tp_group")  # not 0.5.23's deprecated getter
    if the_plan.dry_run:
        _attach_dry_run_backend(tp, mode)
    if rank == 0:
        _say(rank, f"sglang {version}: {the_plan.describe()}; TP group {tp.unique_name} on "
                   f"{dist.get_backend(tp.device_group)}")
    return Rank(rank=rank, world=world, plan=the_plan, version=version, device=device, ps=ps, tp=tp,
                comm=getattr(tp, "sm120_backend", None), cpu_group=ps.get_world_group().cpu_group, patches=patches,
                log_lines=log_lines)


# ---------------------------------------------------------------------------------------------------------
# checks, agreed by every rank


class Checks:
    """Runs named checks; after each, every rank learns every rank's outcome and all raise together, naming the
    failing ranks (a rank that raised alone would leave its peers waiting in the next collective)."""

    def __init__(self, ctx: Rank):
        self.ctx = ctx
        self.passed: list[str] = []

    def __call__(self, name: str, fn) -> None:
        import traceback

        import torch.distributed as dist

        try:
            fn()
            local = None
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        outcomes: list = [None] * dist.get_world_size(self.ctx.cpu_group)
        dist.all_gather_object(outcomes, local, group=self.ctx.cpu_group)
        failed = {r: o for r, o in enumerate(outcomes) if o}
        if failed:
            detail = "\n".join(f"[rank {r}] {o}" for r, o in sorted(failed.items()))
            raise AssertionError(f"check {name!r} failed ({self.ctx.plan.describe()}, sglang {self.ctx.version}):"
                                 f"\n{detail}")
        self.passed.append(name)
        if self.ctx.rank == 0:
            _say(0, f"check passed: {name}")


def all_ranks_equal(ctx: Rank, tensor) -> bool:
    """Bitwise equality of `tensor` across ranks (compared on the host, over the world's gloo group)."""
    import hashlib

    import torch
    import torch.distributed as dist

    host = tensor.detach().contiguous().cpu()
    if host.dtype in (torch.bfloat16, torch.float16):
        host = host.view(torch.int16)
    digest = hashlib.sha1(host.numpy().tobytes()).hexdigest()
    digests: list = [None] * ctx.world
    dist.all_gather_object(digests, digest, group=ctx.cpu_group)
    return len(set(digests)) == 1


def ints(shape, seed: int, low: int = -8, high: int = 9):
    """Integer-valued bf16 on the host: sums of a few of them are exact in bf16 and in fp32."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=generator).to(torch.bfloat16)


def exact_sum(shape, tag: int, world: int):
    """The sum over ranks of `ints(shape, 1000 * r + tag)`."""
    import torch

    return sum(ints(shape, 1000 * r + tag).float() for r in range(world)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# SGLang code the GPU machine cannot import


def upstream_function(module: str, qualname: str, namespace: dict | None = None):
    """SGLang's own function `qualname` ("Class.method" or "function"), compiled from the installed module's
    source without importing the module (e.g. models.deepseek_v2, whose import needs sgl_kernel's torch ops).
    Only for functions that use nothing from their module beyond builtins and `namespace` (typing names are
    provided)."""
    from sglang_sm120.hooks.installed import find_module_spec

    spec = find_module_spec(module)
    if spec is None or not spec.origin:
        raise ImportError(f"{module} not found")
    tree = ast.parse(open(spec.origin, encoding="utf-8-sig").read())
    *owners, name = qualname.split(".")
    body = tree.body
    for owner in owners:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        if not found:
            raise AttributeError(f"{module} has no class {owner}")
        body = found[0].body
    defs = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not defs:
        raise AttributeError(f"{module}:{qualname} not found")
    node = defs[0]
    node.decorator_list = []
    source = textwrap.dedent(ast.get_source_segment(open(spec.origin, encoding="utf-8-sig").read(), node)
                             or ast.unparse(node))
    import typing

    scope = {k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Sequence", "Tuple", "Union")}
    scope.update(namespace or {})
    exec(compile(ast.unparse(ast.parse(source)), f"<{spec.origin}:{qualname}>", "exec"), scope)
    function = scope[name]
    function.__qualname__, function.__module__ = qualname, module
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else -1
    _say(rank, f"harness (not the overlay): SGLang's {module}:{qualname} compiled from its source, the module "
               "itself cannot be imported here")
    return function


# ---------------------------------------------------------------------------------------------------------
# CPU dry run (SGL_SM120_TEST_DRY_RUN=1)


def _install_dry_run_kernel() -> None:
    """sgl_kernel_sm120.IpcAllReduce -> a gloo-backed stand-in (the overlay imports it at build time)."""
    import sgl_kernel_sm120

    sgl_kernel_sm120.IpcAllReduce = _DryRunIpcAllReduce


class _DryRunIpcAllReduce:
    """Exact fp32 sums over the harness's gloo world (the TP group); the reference add + RMSNorm. CPU tensors only.
    What it runs is decided as the real workspace decides it (sgl_kernel_sm120.policy, with the loaded library's
    limits)."""

    fused_clusters = {"clusters": [], "reason": "CPU dry run: no clusters"}
    sm_budget, use_pdl, warn_after_s = 1, False, 5.0

    def __init__(self, exchange, device, max_numel, dtype=None, *, islands=None, link="auto", memory="device",
                 timeout_s=None):
        from sgl_kernel_sm120 import policy
        from sgl_kernel_sm120.settings import read

        self.device, self.max_numel, self.islands, self.memory = device, int(max_numel), islands, memory
        self.world_size = exchange.world_size
        link = policy.Link.HOST if memory == "host" else policy.Link.PCIE
        self.shape = policy.WorkspaceShape(self.world_size, memory, link, sm_budget=self.sm_budget)
        self.limits = policy.kernel_limits()
        self.timeout_s = 300.0 if timeout_s is None else timeout_s
        drop = read().debug_probe_drop  # the kernel's probe debug switch
        if drop is not None and memory == "device":
            from sgl_kernel_sm120.errors import IpcAllReduceProbeError

            raise IpcAllReduceProbeError([(drop.src, drop.dst, "write never arrived")])
        self.calls = 0
        self._closed = False

    def describe_fused_launch(self) -> str:
        return "one CTA per row (CPU dry run)"

    def admits_fused(self, rows, hidden, dtype) -> bool:
        return (str(dtype) in ("torch.bfloat16", "torch.float16") and 0 < rows * hidden <= self.max_numel
                and hidden % self.limits.elems_per_pack == 0 and hidden <= self.limits.max_fused_hidden)

    def supports(self, inp) -> bool:
        return (not self._closed and str(inp.dtype) in ("torch.bfloat16", "torch.float16") and inp.is_contiguous()
                and 0 < inp.numel() <= self.max_numel and inp.numel() % self.limits.elems_per_pack == 0)

    def supports_add_rmsnorm(self, inp, residual=None, weight=None) -> bool:
        return (self.supports(inp) and inp.dim() == 2 and (residual is None or residual.shape == inp.shape)
                and (weight is None or tuple(weight.shape) == (inp.shape[-1],)))

    def _sum(self, inp):
        import torch.distributed as dist

        acc = inp.float().clone()
        dist.all_reduce(acc)  # the harness's default group: gloo over the TP ranks
        return acc

    def launch(self, route, inp, out=None):
        self.calls += 1
        return self._sum(inp).to(inp.dtype)

    def launch_fused(self, route, inp, residual, weight, eps, norm_out=None, residual_out=None):
        from sgl_kernel_sm120 import reference_add_rmsnorm

        self.calls += 1
        summed = self._sum(inp).to(inp.dtype)
        return reference_add_rmsnorm(summed, residual, weight, eps)

    def calls_completed(self) -> int:
        return self.calls

    def close(self, *, collective=True, barrier_timeout_s=None):
        self._closed = True


def _attach_dry_run_backend(tp, mode: str) -> None:
    """The overlay attaches nothing to a CPU group; attach it as the GroupCoordinator.__init__ seam would on a
    GPU whose gate passed (and set SGLang's PCIe-IPC communicator aside, as the 0.5.23 seam does)."""
    from sglang_sm120.core import config
    from sglang_sm120.core.facts import group_facts
    from sglang_sm120.core.gate import GateDecision
    from sglang_sm120.hooks import upstream_pcie
    from sglang_sm120.hooks.distributed import default_store
    from sglang_sm120.runtime.backend import TPBackend
    from sglang_sm120.runtime.registry import set_group_backend

    settings = dataclasses.replace(config.settings_from_environment(), mode=mode)
    backend = TPBackend.for_group(tp, settings, deterministic=False, store=default_store(),
                                  upstream_note=upstream_pcie.activation_note)
    backend.decision = GateDecision(True, "CPU dry run: gate bypassed by the test harness")
    # P2P between every pair, as the gate saw it; no key facts, so the routes are the seeds (the harness runs with
    # the tune off)
    uuids = [f"GPU-dry-run-{r}" for r in range(tp.world_size)]
    backend.facts = group_facts([{"mode": mode, "node": "dry-run", "uuid": uuid, "p2p": dict.fromkeys(uuids, True)}
                                 for uuid in uuids])
    set_group_backend(tp, backend)
    if getattr(tp, "pcie_ipc_comm", None) is not None:
        upstream_pcie.set_aside_upstream(tp)
