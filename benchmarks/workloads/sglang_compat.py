"""What `bench_verify.py --via-sglang` needs of SGLang, for each supported release (0.5.13.post1 and 0.5.23).

0.5.13.post1 sizes its parallel groups from arguments (`initialize_model_parallel(tensor_model_parallel_size=)`)
and keeps the fusion gate in `layers.communicator`. 0.5.23 reads every width from a process-wide record that a
scheduler publishes before building groups (`runtime_context.publish`), and its gate lives in
`layers.layer_boundary.fusions.allreduce` (the module the fused norm inputs call it from). Looked up at call time,
so the overlay's replacement is what the benchmark gets once the overlay is active.
"""

from __future__ import annotations

import importlib
import importlib.metadata

from benchmarks.harness.io import setup_import_paths, short_exc


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def uses_published_widths() -> bool:
    """True for releases whose parallel state is sized from a published ServerArgs record (0.5.23 on)."""
    try:
        importlib.import_module("sglang.srt.runtime_context")
    except ImportError:
        return False
    return True


def publish_for_benchmark(world_size: int, rank: int, local_rank: int) -> None:
    """0.5.23+: publish the record a TP-only scheduler would, before init_distributed_environment. Nothing to do
    on 0.5.13.post1."""
    if not uses_published_widths():
        return
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", tp_size=world_size)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=local_rank))


def initialize_tp(ps, world_size: int) -> None:
    if uses_published_widths():
        ps.initialize_model_parallel()
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size)


def fusion_gate():
    """SGLang's all-reduce + RMSNorm fusion gate `gate(num_tokens) -> bool` of the installed release."""
    try:
        module = importlib.import_module("sglang.srt.layers.layer_boundary.fusions.allreduce")
        return module.flashinfer_ar_fusion_applies
    except ImportError:
        module = importlib.import_module("sglang.srt.layers.communicator")
        return module.apply_flashinfer_allreduce_fusion


def install_sglang_standins() -> str | None:
    """On machines without real sgl_kernel/flashinfer wheels, SGLang needs the overlay's stand-ins to import.
    Returns None if installed (or not needed), else why not (never raises)."""
    setup_import_paths()
    try:
        from benchmarks.harness import standins

        standins.install()
        return None
    except Exception as e:  # noqa: BLE001
        return short_exc(e)
