"""Test-side patches that let a real `sglang.launch_server` run its TP ranks on ONE GPU (never part of the overlay).

Two parts. `startup()` runs at interpreter start in every process of the server (the test's `sitecustomize.py`,
first on the server's PYTHONPATH, calls it), because SGLang's scheduler processes import FlashInfer when they
unpickle their entry function, before any plugin runs:
- FlashInfer is not installed here (too large to carry). SGLang imports some of its names at module import on
  CUDA, so a stand-in answers those imports (benchmarks/harness/standins.py: every call raises), and
  `sglang.srt.utils.common.is_flashinfer_available` answers False, so every path SGLang gates on it behaves as
  on a machine without FlashInfer (the same as no FlashInfer at all, less the import errors).
  `flashinfer.norm` stays not found, so sglang-kernel's rmsnorm, which prefers FlashInfer's when it imports,
  runs its own kernel.
- FlashMLA (0.5.23's sgl-flash-mla wheel) is not carried: a stand-in answers the import of its backend.
- 0.5.23's DualGemm asks the CuTe DSL (not carried either) whether its SM100 kernel applies: without it, no.

The rest is loaded as an SGLang general plugin (`sglang.srt.plugins` entry point `sm120_server_test`, registered only by
the dist-info that tests/gpu/test_sglang_server.py writes into the server's PYTHONPATH), so SGLang itself runs
it in the launcher and at the start of every scheduler process (`run_scheduler_process` calls `load_plugins()`
before it builds the Scheduler). It does nothing unless SGLANG_SM120_SERVER_TEST_PATCHES=1. Every patch is logged
by every process that applies it, on stderr, as `[sm120 server-test patch] ...`:

- every scheduler on device 0: SGLang asserts `gpu_id_step >= 1`, so rank r asks for device r, which one GPU
  does not have (`CUDA_VISIBLE_DEVICES=0,0` leaves torch with no device at all). The Scheduler is built with
  gpu_id 0 (0.5.13.post1), or the launcher launches every scheduler process with GPU 0 (0.5.23); nothing else
  changes.
- SGLang's groups on gloo: NCCL refuses two ranks on one GPU. `model_runner.get_default_distributed_backend`
  answers "gloo", and `init_model_parallel_group` gets `use_pynccl=False` and no custom, mscclpp or
  symmetric-memory all-reduce (the same patch as tests/gpu/sglang_harness.py's shared mode).
- the launcher's tune (before the ranks start) runs its ranks on GPU 0 too, with NCCL's time injected, since NCCL
  refuses two ranks on one GPU.
- the all-gather inside a captured CUDA graph (the logits of the target and of the draft): gloo stages
  through the host and cannot be captured, so while a stream captures, `GroupCoordinator._all_gather_into_tensor`
  writes this rank's slice into a zeroed buffer of the full size and all-reduces it, in pieces the backend
  routes to our kernels, through the group's own `all_reduce`, which the sm120 backend serves (x + 0 is exact,
  so the gathered bits are the slices' bits; a -0.0 becomes +0.0). Outside capture it is gloo's `all_gather` into
  the output's slices. With the backend off a captured gather cannot run, so the "off" server runs eagerly.

Three test instruments, each logged too:
- teacher forcing: after every target forward (prefill and verify, eager or a graph replay) each logits row's argmax
  is made `forced_successor` of the row's input token, on every rank, before SGLang samples. The random checkpoint
  is nearly uniform, so its greedy choices are near ties that one rounding flips, and two servers' texts part
  within a few tokens; forced, every server reads the same tokens, and each verify forward's first row (the last
  accepted token, whose prefix is all forced) compares row for row between servers. The row's logprob of the
  forced token, its unforced argmax and that argmax's lead are taken before the forcing (`force_rows`).
- a per-kind device counter: `TPBackend.run` / `run_fused` also add 1 to a slot of a small device tensor (plain,
  fused, or gather: a plain call made by the captured all-gather below). The increment is an ordinary kernel on
  the call's stream, so a CUDA graph captures it beside the call and every replay counts again, where the
  backend's `stats` counted the captured call once.
- negative controls: a prompt holding one of FAULT_WORDS arms that fault in the target's forwards until the next
  prefill without one (only with SGLANG_SM120_SERVER_TEST_FAULTS=1; requests go one at a time, and every rank reads
  the same tokens, so the ranks arm together). "shard_at_verify": every fused call of a verify forward returns
  this rank's own shard through the add + RMSNorm, no peer's (an all-reduce that summed nothing, at the verify
  size only); "capture_guard_off": the overlay's mark that keeps the MLP all-reduce of a layer feeding an
  EAGLE-3 capture is lifted, so that all-reduce defers into the next layer's norm and the capture reads a partial
  sum (the hazard hooks/fusion.py guards on 0.5.13.post1). Graph replays run what was captured: the faults
  reach eager forwards only.

One record, not a patch: every `ModelRunner.forward` (target and draft, both releases) logs one line
`[sm120 server-test forward] {json}` on TP rank 0: draft or target, forward mode, tokens, whether a CUDA graph
ran it, how the TP backend's Python counters moved across it (`backend_stats`), how the per-kind device
counter and the kernels' own device call counter moved (`device_counts`, the GPU synchronized around the
forward), the armed fault, the teacher-forced rows (`force_rows`, with their positions), and for a
target-verify forward a digest of the EAGLE-3 captures of its first row (`capture_digest`). At most
FORWARD_LINES lines a process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import sys

from tests.gpu.kimi_shaped_model import SPECIAL, words

# SGLang 0.5.13.post1 warns about every SGL_-prefixed variable as a deprecated spelling of SGLANG_...
PATCH_ENV = "SGLANG_SM120_SERVER_TEST_PATCHES"
FAULTS_ENV = "SGLANG_SM120_SERVER_TEST_FAULTS"
FORWARD_TAG = "[sm120 server-test forward]"
FORWARD_LINES = 5000
# Fixed +-1 directions the capture digest projects on: the same on every server, so two runs' digests compare.
# Each projection of a difference e is a sample of rms(e): 16 of them estimate it within about 18%.
DIGEST_PROJECTIONS = 16
# The forced successor: an affine map over the ordinary words (a special token, EOS among them, is never forced).
FORCE_STEP, FORCE_OFFSET = 7919, 104729
# Added to a row's largest logit for its forced token: far above any logit of the checkpoint, finite in bf16.
FORCE_MARGIN = 1000.0
FAULT_WORDS = {"shard_at_verify": "w32000", "capture_guard_off": "w32001"}
# The per-kind device counter's slots.
KINDS = ("plain", "fused", "gather")
KINDS_ATTR = "_sm120_server_test_kinds"
_applied = False
_started = False
_armed: str | None = None  # the fault the last target prefill armed
_fault_now: str | None = None  # the fault applied to the forward running now
_gathering = False  # inside the captured all-gather: its plain calls count as "gather"


def say(text: str) -> None:
    print(f"[sm120 server-test patch pid {os.getpid()}] {text}", file=sys.stderr, flush=True)


def startup() -> None:
    global _started
    if os.environ.get(PATCH_ENV) != "1" or _started:
        return
    _started = True
    import importlib.util

    from benchmarks.harness.standins import StandInFinder

    # flashinfer.norm is left not found: sglang-kernel's own rmsnorm tries to import it and, found, would hand
    # every norm to it; SGLang itself imports it nowhere. Everything else SGLang imports at module import.
    # 0.5.23's draft graph capture imports FlashMLA's backend (to ask whether the draft's attention backend is
    # one it can capture); its sgl-flash-mla wheel is not carried either, and the Triton backend here is not it.
    roots = ("flashinfer",) + (("flash_mla",) if importlib.util.find_spec("flash_mla") is None else ())
    sys.meta_path.insert(0, StandInFinder(roots, not_found=("flashinfer.norm",)))
    sys.meta_path.insert(0, _AfterImport("sglang.srt.utils.common", _no_flashinfer))
    sys.meta_path.insert(0, _AfterImport("sglang.srt.layers.dual_gemm", _no_cute_dsl_dual_gemm))


def _no_flashinfer(module) -> None:
    module.is_flashinfer_available = lambda: False
    say("utils.common.is_flashinfer_available: False (FlashInfer is a stand-in here)")


def _no_cute_dsl_dual_gemm(module) -> None:
    """0.5.23's DualGemm (the draft's Llama MLP) imports the CuTe DSL (nvidia-cutlass-dsl, not carried) only to ask
    whether its SM100 kernel applies, which on this GPU it never does: without the DSL the layer gets no dual GEMM,
    the answer the DSL would give here."""
    original = module.DualGemm._select_mode

    def _select_mode(self, gate_up_proj, hidden_size):
        try:
            return original(self, gate_up_proj, hidden_size)
        except ModuleNotFoundError as exc:
            if exc.name != "cutlass":
                raise
            return None

    module.DualGemm._select_mode = _select_mode
    say("layers.dual_gemm.DualGemm: no dual GEMM without the CuTe DSL (an SM100 kernel)")


class _AfterImport:
    """A meta-path finder that runs `then(module)` right after `name` executes, before its importer continues
    (`sglang.srt.utils` star-imports `common`, and every module imports the function from there by name)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                then(module)

        spec.loader = _Loader()
        return spec


def activate() -> None:
    global _applied
    if os.environ.get(PATCH_ENV) != "1" or _applied:
        return
    _applied = True
    _every_scheduler_on_device_0()
    _groups_on_gloo()
    _captured_all_gather_as_all_reduce()
    _count_calls_on_the_device()
    _record_forwards()
    _tune_on_the_shared_gpu()


def _tune_on_the_shared_gpu() -> None:
    """The launcher's tune (sglang_sm120.hooks.startup) with its ranks on GPU 0, where the schedulers are, and
    NCCL's time injected: NCCL refuses two ranks on one GPU, and time-sliced ranks' times mean nothing anyway."""
    from sglang_sm120.hooks import startup

    original = startup.tune_command
    if getattr(original, "_sm120_server_test", False):
        return

    def tune_command(server_args, settings):
        command = original(server_args, settings)
        if command is not None:
            at = command.index("--gpus") + 1
            command[at] = ",".join("0" for _ in command[at].split(","))
            command += ["--share-gpu", "--debug-nccl-us", "1000000"]
            say(f"launcher's tune on GPU 0 with NCCL's time injected: {' '.join(command[1:])}")
        return command

    tune_command._sm120_server_test = True
    startup.tune_command = tune_command
    say("hooks.startup.tune_command: ranks share GPU 0, NCCL's time injected")


def _every_scheduler_on_device_0() -> None:
    from sglang.srt.entrypoints import engine

    if hasattr(engine, "maybe_reindex_device_id"):  # 0.5.23: the launcher hands each scheduler process its GPU
        _every_scheduler_process_on_device_0(engine)
        return
    from sglang.srt.managers import scheduler as scheduler_module

    original = scheduler_module.Scheduler
    if getattr(original, "_sm120_server_test", False):
        return

    # run_scheduler_process looks `Scheduler` up as a module global when it builds it, after load_plugins().
    class Scheduler(original):
        _sm120_server_test = True

        def __init__(self, server_args, port_args, gpu_id, *args, **kwargs):
            if gpu_id != 0:
                say(f"scheduler asked for GPU {gpu_id}: built on GPU 0 (ranks share one GPU)")
            super().__init__(server_args, port_args, 0, *args, **kwargs)

    Scheduler.__qualname__ = original.__qualname__
    Scheduler.__module__ = original.__module__
    scheduler_module.Scheduler = Scheduler
    say("managers.scheduler.Scheduler: gpu_id 0 for every rank")


def _every_scheduler_process_on_device_0(engine) -> None:
    """0.5.23 computes each scheduler's GPU in the launcher and publishes it to the process's runtime context
    (`get_device().gpu_id`); the Scheduler takes none. The launcher passes every GPU id through
    `maybe_reindex_device_id`, looked up in the engine module at each launch: it answers 0."""
    import contextlib

    original = engine.maybe_reindex_device_id
    if getattr(original, "_sm120_server_test", False):
        return

    @contextlib.contextmanager
    def maybe_reindex_device_id(gpu_id):
        if gpu_id != 0:
            say(f"scheduler process asked for GPU {gpu_id}: launched on GPU 0 (ranks share one GPU)")
        with original(0) as reindexed:
            yield reindexed

    maybe_reindex_device_id._sm120_server_test = True
    engine.maybe_reindex_device_id = maybe_reindex_device_id
    say("entrypoints.engine.maybe_reindex_device_id: GPU 0 for every scheduler process")


def _groups_on_gloo() -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.model_executor import model_runner

    model_runner.get_default_distributed_backend = lambda device: "gloo"
    say("model_runner.get_default_distributed_backend: gloo (NCCL refuses two ranks on one GPU)")
    try:  # 0.5.23 chooses it in distributed/bootstrap.py
        from sglang.srt.distributed import bootstrap
    except ImportError:
        bootstrap = None
    if bootstrap is not None and hasattr(bootstrap, "get_default_distributed_backend"):
        bootstrap.get_default_distributed_backend = lambda device: "gloo"
        say("distributed.bootstrap.get_default_distributed_backend: gloo")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tests.gpu.sglang_harness import patch_groups_for_shared_gpus

    for line in patch_groups_for_shared_gpus(ps, rank=-1, log=False):
        say(line)


def _captured_all_gather_as_all_reduce() -> None:
    import torch
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    from sglang_sm120.runtime.registry import group_backend

    original = GroupCoordinator._all_gather_into_tensor
    if getattr(original, "_sm120_server_test", False):
        return
    served = {"captured": 0, "eager": 0}

    @functools.wraps(original)
    def _all_gather_into_tensor(self, output, input):
        global _gathering
        if self.world_size == 1 or input.device.type != "cuda":
            return original(self, output, input)
        if torch.cuda.is_current_stream_capturing():
            padded = torch.zeros_like(output)
            n = input.shape[0]
            padded[self.rank_in_group * n:(self.rank_in_group + 1) * n].copy_(input)
            # In pieces the backend takes: the logits over a 32,768-word vocabulary are past the byte bound, a size
            # between two measured ones whose routes differ goes to NCCL (routing/table.py), and a piece that went
            # to SGLang's own path (gloo here) would end the capture. So each piece is the largest the backend
            # routes to our kernels, halving from the bound.
            backend = group_backend(self)
            flat, gathered = padded.view(-1), output.view(-1)
            cap = flat.numel() if backend is None else max(8, backend.max_bytes // flat.element_size() // 8 * 8)
            start = 0
            while start < flat.numel():
                size = min(cap, flat.numel() - start)
                while backend is not None and size > 8 and backend.route_for(flat[start:start + size]) is None:
                    size = max(8, size // 2 // 8 * 8)
                piece = flat[start:start + size]
                if backend is None or backend.route_for(piece) is None:
                    raise RuntimeError(f"{self.unique_name}: a captured all-gather piece {tuple(piece.shape)} "
                                       f"{piece.dtype} is not the sm120 backend's, and gloo cannot be captured")
                _gathering = True
                try:
                    gathered[start:start + size].copy_(self.all_reduce(piece))
                finally:
                    _gathering = False
                start += size
            served["captured"] += 1
            if served["captured"] == 1:
                say(f"{self.unique_name}: captured all-gather {tuple(input.shape)} -> zero-padded all_reduce")
            return None
        dist.all_gather(list(output.chunk(self.world_size)), input.contiguous(), group=self.device_group)
        served["eager"] += 1
        if served["eager"] == 1:
            say(f"{self.unique_name}: eager all-gather through gloo's all_gather")
        return None

    _all_gather_into_tensor._sm120_server_test = True
    GroupCoordinator._all_gather_into_tensor = _all_gather_into_tensor
    say("GroupCoordinator._all_gather_into_tensor: captured -> zero-padded all_reduce; eager -> gloo all_gather")


def _count_calls_on_the_device() -> None:
    """The per-kind device counter (module docstring), and the negative control "shard_at_verify"."""
    import torch

    from sgl_kernel_sm120 import reference_add_rmsnorm
    from sglang_sm120.runtime.backend import TPBackend

    build, run, run_fused = TPBackend.build, TPBackend.run, TPBackend.run_fused
    if getattr(run, "_sm120_server_test", False):
        return

    # Allocated when the workspace is, before any CUDA-graph capture: a tensor allocated while capturing would
    # come from the graph's pool, and its zeroing would be captured and replayed.
    @functools.wraps(build)
    def build_counted(self, *args, **kwargs):
        built = build(self, *args, **kwargs)
        if built and getattr(self, KINDS_ATTR, None) is None and not torch.cuda.is_current_stream_capturing():
            setattr(self, KINDS_ATTR, torch.zeros(len(KINDS), dtype=torch.int64, device=self.device))
        return built

    @functools.wraps(run)
    def run_counted(self, inp, route):
        count_call(self, "plain")
        return run(self, inp, route)

    @functools.wraps(run_fused)
    def run_fused_counted(self, x, residual, weight, eps, route):
        count_call(self, "fused")
        if _fault_now == "shard_at_verify":  # dispatched as ever, summed nothing: the same on every rank
            self.stats["sm120_fused"] += 1
            return reference_add_rmsnorm(x.float(), residual, weight, eps)
        return run_fused(self, x, residual, weight, eps, route)

    for name, wrapper in (("build", build_counted), ("run", run_counted), ("run_fused", run_fused_counted)):
        wrapper._sm120_server_test = True
        setattr(TPBackend, name, wrapper)
    say("runtime.backend.TPBackend.run / run_fused: each call also counted per kind on the device (graph replays "
        "included); the negative control shard_at_verify")


def count_call(backend, kind: str) -> None:
    """One call of `kind` on the backend's device counter, on the call's stream (captured with it)."""
    kinds = getattr(backend, KINDS_ATTR, None)
    if kinds is not None:
        slot = KINDS.index("gather" if _gathering and kind == "plain" else kind)
        kinds[slot:slot + 1].add_(1)


def backend_stats(group) -> dict | None:
    """The TP backend's Python-side counters (plain / fused / fallback / fused_fallback calls), or None without
    a backend: the one place that knows where the overlay keeps its backend on SGLang's group."""
    from sglang_sm120.runtime.registry import group_backend

    backend = group_backend(group)
    return dict(backend.stats) if backend is not None else None


def device_counts(group) -> dict | None:
    """The per-kind device counter and the kernels' own device call counter (`kernel`), or None without them.
    Exact only with the device synchronized (the caller's job)."""
    from sglang_sm120.runtime.registry import group_backend

    backend = group_backend(group)
    kinds = getattr(backend, KINDS_ATTR, None) if backend is not None else None
    if kinds is None:
        return None
    return {**dict(zip(KINDS, kinds.tolist(), strict=True)), "kernel": backend.device_calls()}


def counts_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: None if after[k] is None or before.get(k) is None else after[k] - before[k] for k in after}


def capture_digest(aux, hidden: int) -> list[list[float]] | None:
    """Per EAGLE-3 capture, of the forward's first row (the last accepted token: teacher-forced, its inputs are the
    same in every run, whatever the draft proposed after it): the rms and DIGEST_PROJECTIONS
    projections on fixed +-1 directions over sqrt(hidden). Two captures x and x + e give projections that differ
    by about rms(e), so the digests compare the captures within a relative error, not bit for bit."""
    import torch

    if isinstance(aux, (list, tuple)):
        aux = torch.cat(list(aux), dim=-1) if aux else None
    if not isinstance(aux, torch.Tensor) or aux.ndim != 2 or aux.shape[0] == 0 or aux.shape[1] % hidden:
        return None
    rows = aux[0].float().view(-1, hidden)
    gen = torch.Generator(device="cpu").manual_seed(0)
    signs = (torch.randint(0, 2, (DIGEST_PROJECTIONS, hidden), generator=gen) * 2 - 1).float().to(rows.device)
    proj = rows @ signs.T / hidden ** 0.5
    rms = rows.pow(2).mean(dim=1).sqrt()
    return torch.cat([rms[:, None], proj], dim=1).cpu().tolist()


def forced_successor(token, vocab: int):
    """The token forced after `token` (an int, or an integer tensor elementwise) in a vocabulary of `vocab`."""
    first = len(SPECIAL)
    return first + (token * FORCE_STEP + FORCE_OFFSET) % (vocab - first)


def logits_rows(forward_batch, verify: bool) -> tuple[list[int], list[int], list[int]]:
    """For a target forward's logits rows: each row's input token, the rows to digest, and their positions. A
    verify forward has a row per input token, and a request's first row is its last accepted token; a prefill
    has a row per request, its last token."""
    ids = forward_batch.input_ids.tolist()
    positions = forward_batch.positions.tolist()
    if verify:
        rows = list(range(0, len(ids), max(1, len(ids) // max(1, int(forward_batch.batch_size)))))
        return ids, rows, [positions[r] for r in rows]
    lens = forward_batch.extend_seq_lens_cpu
    ends = list(itertools.accumulate(int(n) for n in (lens if lens is not None else forward_batch.extend_seq_lens)))
    return [ids[e - 1] for e in ends], list(range(len(ends))), [positions[e - 1] for e in ends]


def force_rows(logits, inputs: list[int], digest: list[int]) -> list[dict]:
    """Teacher forcing, in place: row r's argmax becomes forced_successor(inputs[r]). For each row in `digest`,
    before the forcing: the logprob of its forced token (`lp`), its argmax (`top`), the argmax's logprob and its
    lead over the runner-up."""
    import torch

    if logits.ndim != 2 or logits.shape[0] != len(inputs):
        raise RuntimeError(f"teacher forcing: logits {tuple(logits.shape)} for {len(inputs)} input rows")
    forced = forced_successor(torch.tensor(inputs, dtype=torch.int64, device=logits.device), logits.shape[-1])
    rows = torch.tensor(digest, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    top = logprobs.topk(2, dim=-1)
    values = torch.stack([logprobs.gather(1, forced[rows, None])[:, 0].double(), top.values[:, 0].double(),
                          top.values[:, 1].double(), top.indices[:, 0].double()], dim=1).tolist()
    logits.scatter_(1, forced[:, None], logits.max(dim=-1, keepdim=True).values + FORCE_MARGIN)
    return [{"lp": lp, "top": int(arg), "top_lp": first, "lead": first - second}
            for lp, first, second, arg in values]


@functools.cache
def fault_tokens() -> dict[int, str]:
    """Token id -> the fault its word arms (kimi_shaped_model's token ids are vocabulary positions)."""
    vocabulary = words()
    return {vocabulary.index(word): fault for fault, word in FAULT_WORDS.items()}


def fault_in(token_ids: list[int]) -> str | None:
    """The fault a prefill's tokens arm, or None."""
    tokens = fault_tokens()
    return next((tokens[t] for t in token_ids if t in tokens), None)


@contextlib.contextmanager
def fault_applied(fault: str | None, model, verify: bool):
    """`fault` on this target forward: shard_at_verify in run_fused (verify forwards only), capture_guard_off
    as the keep marks lifted from `model`'s layer communicators meanwhile. Returns how many marks were lifted."""
    global _fault_now
    from sglang_sm120.hooks.fusion import KEEP_MLP_ALLREDUCE

    lifted = []
    if fault == "capture_guard_off":
        lifted = [m.layer_communicator for m in model.modules()
                  if getattr(getattr(m, "layer_communicator", None), KEEP_MLP_ALLREDUCE, False)]
        for communicator in lifted:
            setattr(communicator, KEEP_MLP_ALLREDUCE, False)
    _fault_now = fault if fault != "shard_at_verify" or verify else None
    try:
        yield len(lifted)
    finally:
        _fault_now = None
        for communicator in lifted:
            setattr(communicator, KEEP_MLP_ALLREDUCE, True)


def _record_forwards() -> None:
    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_executor.model_runner import ModelRunner

    original = ModelRunner.forward
    if getattr(original, "_sm120_server_test", False):
        return
    lines = [0]
    faults = os.environ.get(FAULTS_ENV) == "1"
    said: set[str] = set()

    @functools.wraps(original)
    def forward(self, forward_batch, *args, **kwargs):
        global _armed
        if torch.cuda.is_current_stream_capturing():
            return original(self, forward_batch, *args, **kwargs)
        mode = forward_batch.forward_mode
        target = not self.is_draft_worker
        verify = target and mode.is_target_verify()
        prefill = target and not verify and mode.is_extend()
        rows = logits_rows(forward_batch, verify) if verify or prefill else None
        if prefill and faults:  # on every rank, from the same tokens
            _armed = fault_in(forward_batch.input_ids.tolist())
        fault = _armed if target else None
        group = parallel_state.get_tp_group()
        record = group.rank_in_group == 0 and lines[0] < FORWARD_LINES
        if record:
            torch.cuda.synchronize()
            before, device_before = backend_stats(group), device_counts(group)
        with fault_applied(fault, self.model, verify) as lifted:
            out = original(self, forward_batch, *args, **kwargs)
        logits = getattr(getattr(out, "logits_output", None), "next_token_logits", None)
        forced = None
        if rows is not None and logits is not None:  # on every rank: each samples from its own logits
            inputs, digest, positions = rows
            forced = [{"pos": p, **row} for p, row in zip(positions, force_rows(logits, inputs, digest), strict=True)]
        if fault and fault not in said:
            said.add(fault)
            say(f"negative control {fault} armed" + (f": {lifted} keep marks lifted" if lifted else ""))
        if not record:
            return out
        torch.cuda.synchronize()
        after, device_after = backend_stats(group), device_counts(group)
        record = {"draft": bool(self.is_draft_worker), "mode": getattr(mode, "name", str(mode)),
                  "tokens": int(forward_batch.input_ids.shape[0]) if forward_batch.input_ids is not None else None,
                  "graph": bool(getattr(out, "can_run_graph", False)),
                  "delta": counts_delta(before, after), "device": counts_delta(device_before, device_after),
                  "fault": fault, "forced": forced}
        if verify:
            logits_output = getattr(out, "logits_output", None)
            record["capture"] = capture_digest(getattr(logits_output, "hidden_states", None),
                                               self.model_config.hidden_size)
        lines[0] += 1
        print(f"{FORWARD_TAG} {json.dumps(record)}", file=sys.stderr, flush=True)
        return out

    forward._sm120_server_test = True
    ModelRunner.forward = forward
    say("model_runner.ModelRunner.forward: every target row's argmax forced to the successor of its input token; "
        "one line per forward on TP rank 0 (mode, tokens, backend and device counters, forced rows, capture "
        "digest)" + ("; negative controls armed by " + ", ".join(FAULT_WORDS.values()) if faults else ""))
