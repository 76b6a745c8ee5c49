"""A box whose P2P data path drops writes must not run the P2P workspace, and must say why (issue: broken P2P).

The kernel's debug switch SGL_SM120_DEBUG_PROBE_DROP=1:0 makes rank 1's construction probe skip its writes to
rank 0 and corrupt its loads from it, which is what ACS redirection or a translating IOMMU does to real traffic
while cudaDeviceCanAccessPeer still says yes; like such a fault it leaves the host-memory workspace alone (no
`@host`), so the retry there builds. Server-style init (SGLang's own init_distributed_environment +
initialize_model_parallel, the overlay's pre-capture seam; either supported release, one GPU per rank or ranks
sharing one: see tests/gpu/sglang_harness.py), then:
- SGLANG_SM120_HOSTMEM=off: the backend is off on every rank, the failing pair in the reason and in the
  DISABLED line, and all-reduces still correct (SGLang's own path);
- SGLANG_SM120_HOSTMEM=auto (the default): the workspace is rebuilt once in pinned host memory, the pair is
  named in the retry warning, and small all-reduces are exact sums served by the sm120 kernels.
"""

from __future__ import annotations

import pytest

from tests.gpu import sglang_harness
from tests.gpu.sglang_harness import Checks, exact_sum, ints

DRY_RUN_OK = True  # runs on a CPU with SGL_SM120_TEST_DRY_RUN=1 (tests/gpu/sglang_harness.py)
WORLD = 2
HIDDEN = 7168

pytestmark = [pytest.mark.gpu, sglang_harness.needs(WORLD)]


@pytest.mark.parametrize("hostmem", ["off", "auto"])
def test_probe_failure_names_the_pair_and_leaves_the_p2p_path(hostmem):
    sglang_harness.run(WORLD, _worker, hostmem, timeout_s=300)


def _worker(rank: int, world: int, plan, hostmem: str) -> None:
    import torch

    ctx = sglang_harness.start(rank, world, plan, mode="on",
                               env={"SGLANG_SM120_HOSTMEM": hostmem, "SGL_SM120_DEBUG_PROBE_DROP": "1:0"})
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    from sglang_sm120.hooks import distributed as hooks_distributed

    comm, device, lines = ctx.comm, ctx.device, ctx.log_lines
    check = Checks(ctx)

    def gate():
        assert comm is not None and comm.gate_enabled, f"gate: {getattr(comm, 'decision', None)}"

    check("gate passes (the capability says yes)", gate)
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
        assert comm.memory == "host" and comm.workspace.memory == "host", (comm.memory,
                                                                          getattr(comm.workspace, "memory", None))
        if rank == 0:
            retry = [line for line in lines if "data-path probe failed" in line and "used instead" in line]
            enabled = [line for line in lines if "ENABLED" in line]
            assert len(retry) == 1 and "rank 1 -> rank 0" in retry[0], lines
            assert len(enabled) == 1 and "transport: pinned host memory" in enabled[0], lines

    if hostmem == "off":
        check("probe failure -> SGLang's own path, pair named", probe_turns_it_off)
    else:
        check("probe failure -> host memory, pair named", probe_moves_it_to_host_memory)

    def still_correct():
        for rows in (1, 3, 32):
            out = tensor_model_parallel_all_reduce(ints((rows, HIDDEN), 1000 * rank + rows).to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(out.cpu(), exact_sum((rows, HIDDEN), rows, world)), f"rows={rows}: wrong sum"
        assert comm.stats["sm120"] == (0 if hostmem == "off" else 3), comm.stats

    check("all-reduces correct, served by the path the build chose", still_correct)
    ctx.finish()
