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

The rest is loaded as an SGLang general plugin (`sglang.srt.plugins` entry point `sm120_server_test`, registered only by
the dist-info that tests/gpu/test_sglang_server.py writes into the server's PYTHONPATH), so SGLang itself runs
it in the launcher and at the start of every scheduler process (`run_scheduler_process` calls `load_plugins()`
before it builds the Scheduler). It does nothing unless SGLANG_SM120_SERVER_TEST_PATCHES=1. Every patch is logged
by every process that applies it, on stderr, as `[sm120 server-test patch] ...`:

- every scheduler on device 0: SGLang asserts `gpu_id_step >= 1`, so rank r asks for device r, which one GPU
  does not have (`CUDA_VISIBLE_DEVICES=0,0` leaves torch with no device at all). The Scheduler is built with
  gpu_id 0; nothing else changes.
- SGLang's groups on gloo: NCCL refuses two ranks on one GPU. `model_runner.get_default_distributed_backend`
  answers "gloo", and `init_model_parallel_group` gets `use_pynccl=False` and no custom, mscclpp or
  symmetric-memory all-reduce (the same patch as tests/gpu/sglang_harness.py's shared mode).
- the all-gather inside a captured CUDA graph (the logits of the target and of the draft): gloo stages
  through the host and cannot be captured, so while a stream captures, `GroupCoordinator._all_gather_into_tensor`
  writes this rank's slice into a zeroed buffer of the full size and all-reduces it through the group's own
  `all_reduce`, which the sm120 backend serves (x + 0 is exact, so the gathered bits are the slices' bits;
  a -0.0 becomes +0.0). Outside capture it is gloo's `all_gather` into the output's slices. With the backend
  off a captured gather cannot run, so the "off" server runs eagerly.
"""

from __future__ import annotations

import functools
import os
import sys

# SGLang 0.5.13.post1 warns about every SGL_-prefixed variable as a deprecated spelling of SGLANG_...
PATCH_ENV = "SGLANG_SM120_SERVER_TEST_PATCHES"
_applied = False
_started = False


def say(text: str) -> None:
    print(f"[sm120 server-test patch pid {os.getpid()}] {text}", file=sys.stderr, flush=True)


def startup() -> None:
    global _started
    if os.environ.get(PATCH_ENV) != "1" or _started:
        return
    _started = True
    from benchmarks.harness.standins import StandInFinder

    # flashinfer.norm is left not found: sglang-kernel's own rmsnorm tries to import it and, found, would hand
    # every norm to it; SGLang itself imports it nowhere. Everything else SGLang imports at module import.
    sys.meta_path.insert(0, StandInFinder(("flashinfer",), not_found=("flashinfer.norm",)))
    sys.meta_path.insert(0, _AfterImport("sglang.srt.utils.common", _no_flashinfer))


def _no_flashinfer(module) -> None:
    module.is_flashinfer_available = lambda: False
    say("utils.common.is_flashinfer_available: False (FlashInfer is a stand-in here)")


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


def _every_scheduler_on_device_0() -> None:
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


def _groups_on_gloo() -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.model_executor import model_runner

    model_runner.get_default_distributed_backend = lambda device: "gloo"
    say("model_runner.get_default_distributed_backend: gloo (NCCL refuses two ranks on one GPU)")
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

    original = GroupCoordinator._all_gather_into_tensor
    if getattr(original, "_sm120_server_test", False):
        return
    served = {"captured": 0, "eager": 0}

    @functools.wraps(original)
    def _all_gather_into_tensor(self, output, input):
        if self.world_size == 1 or input.device.type != "cuda":
            return original(self, output, input)
        if torch.cuda.is_current_stream_capturing():
            padded = torch.zeros_like(output)
            n = input.shape[0]
            padded[self.rank_in_group * n:(self.rank_in_group + 1) * n].copy_(input)
            output.copy_(self.all_reduce(padded))
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
