"""A box whose P2P data path drops writes must not run the P2P workspace, and must say why (issue: broken P2P).

The kernel's debug switch SGL_SM120_DEBUG_PROBE_DROP=1:0 makes rank 1's construction probe skip its write to
rank 0, which is what ACS redirection or a translating IOMMU does to real writes while cudaDeviceCanAccessPeer
still says yes. Server-style init (SGLang's own init_distributed_environment + initialize_model_parallel, the
overlay's pre-capture seam), then:
- SGLANG_SM120_HOSTMEM=off: the backend is off on every rank, the failing pair in the reason and in the
  DISABLED line, and all-reduces still correct (SGLang's own path);
- SGLANG_SM120_HOSTMEM=auto (the default): the workspace is rebuilt once in pinned host memory, the pair is
  named in the retry warning, and small all-reduces are exact sums served by the sm120 kernels. Needs the
  kernel package's memory="host" workspace; written before that existed on a GPU here, not yet run.
Needs 2 GPUs and the sglang wheels.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.gpu.test_sglang_integration import HIDDEN, WORLD, _Checks, _exact_sum, _free_port, _ints

DEADLINE_S = 300


@pytest.mark.gpu(2)
@pytest.mark.parametrize("hostmem", ["off", "auto"])
def test_probe_failure_names_the_pair_and_leaves_the_p2p_path(hostmem):
    import importlib.util

    import torch.multiprocessing as mp

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    context = mp.start_processes(_worker, args=(WORLD, _free_port(), hostmem), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"ranks did not finish within {DEADLINE_S}s")


def _worker(rank: int, world: int, port: int, hostmem: str) -> None:
    import logging

    os.environ["SGLANG_SM120_ALLREDUCE"] = "on"
    os.environ["SGLANG_SM120_HOSTMEM"] = hostmem
    os.environ["SGL_SM120_DEBUG_PROBE_DROP"] = "1:0"
    from sglang_sm120.testing import standins

    standins.install()
    import torch

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("sglang_sm120").addHandler(Collect(level=logging.WARNING))

    import sglang_sm120

    sglang_sm120.activate()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    from sglang_sm120.hooks import distributed as hooks_distributed

    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", backend="nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    comm = ps.get_tp_group().sm120_comm
    check = _Checks(ps.get_world_group().cpu_group, rank)
    check("gate passes (the capability says yes)", lambda: (comm is not None and comm.gate_enabled) or _fail(comm))

    runner = type("Runner", (), {})()
    runner.server_args = None  # settings come from the environment, as with sglang.Engine
    runner.model_config = type("ModelConfig", (), {"hidden_size": HIDDEN})()
    runner.dtype = torch.bfloat16

    def probe_turns_it_off():
        hooks_distributed.wrap_pre_capture(lambda self: None)(runner)
        assert not comm.active, "the workspace was built although rank 1's probe writes to rank 0 were dropped"
        assert "IpcAllReduceProbeError" in comm.build_error and "rank 1 -> rank 0" in comm.build_error, comm.build_error
        assert "SGLANG_SM120_HOSTMEM=off" in comm.build_error, comm.build_error
        if rank == 0:
            disabled = [line for line in lines if "DISABLED" in line]
            assert len(disabled) == 1 and "rank 1 -> rank 0" in disabled[0], lines

    def probe_moves_it_to_host_memory():
        hooks_distributed.wrap_pre_capture(lambda self: None)(runner)
        assert comm.active, f"the host-memory retry did not build: {comm.build_error}"
        assert comm.memory == "host" and comm.comm.memory == "host", (comm.memory, getattr(comm.comm, "memory", None))
        if rank == 0:
            retry = [line for line in lines if "data-path probe failed" in line and "used instead" in line]
            enabled = [line for line in lines if "ENABLED" in line]
            assert len(retry) == 1 and "rank 1 -> rank 0" in retry[0], lines
            assert len(enabled) == 1 and "transport: pinned host memory" in enabled[0], lines

    if hostmem == "off":
        check("probe failure -> NCCL, pair named", probe_turns_it_off)
    else:
        check("probe failure -> host memory, pair named", probe_moves_it_to_host_memory)

    def still_correct():
        for rows in (1, 3, 32):
            out = tensor_model_parallel_all_reduce(_ints((rows, HIDDEN), 1000 * rank + rows).to(device))
            torch.cuda.synchronize()
            assert torch.equal(out, _exact_sum((rows, HIDDEN), rows, world).to(device)), f"rows={rows}: wrong sum"
        if hostmem == "off":
            assert comm.stats["sm120"] == 0, comm.stats
        else:
            assert comm.stats["sm120"] == 3, comm.stats

    check("all-reduces correct", still_correct)
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def _fail(comm):
    raise AssertionError(f"gate: {getattr(comm, 'decision', None)}")
