"""The launcher's tune: before SGLang starts its ranks, `python -m sglang_sm120.tune` for this server's TP size,
GPUs, hidden size, dtype and captured sizes, so that the ranks find a table measured on this box (docs/tuning.md
says when it runs and how it is bounded). It runs before SGLang has allocated anything, in its own processes, one
per GPU; whatever happens, the launch goes on: a rank that finds no table sends every size to NCCL and says why.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time

from sgl_kernel_sm120.policy import ELEMENT_BYTES

from ..core import config
from ..core.gate import SM120, SUPPORTED_WORLD_SIZES

logger = logging.getLogger("sglang_sm120")

# After the tool's own deadline, how long it gets to write its failure note and end before it is ended.
KILL_GRACE_S = 20.0


def _capabilities(gpus: list[int]) -> list[tuple[int, int]] | None:
    """The GPUs' compute capabilities from NVML (no CUDA context in the launcher), by CUDA's order."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            out = []
            for gpu in gpus:
                which = visible[gpu].strip() if visible else str(gpu)
                handle = (pynvml.nvmlDeviceGetHandleByUUID(which) if which.startswith(("GPU-", "MIG-"))
                          else pynvml.nvmlDeviceGetHandleByIndex(int(which)))
                out.append(tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def resolved(server_args, *names):
    """The first of the fields `names` that is set, as SGLang resolved it (0.5.23 declares resolved values beside
    the raw fields and renamed the decode graph fields; 0.5.13.post1 writes the fields)."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:
        return config.server_arg(server_args, *names)
    return next((value for value in (resolution_result(server_args, n) for n in names) if value), None)


def tune_command(server_args, settings: config.OverlaySettings) -> list[str] | None:
    """The tool's command line for this server, or None when no tune is due (with the reason logged at INFO)."""
    tp = int(resolved(server_args, "tp_size") or 1)
    if settings.mode == "off" or settings.tune == "off" or tp not in SUPPORTED_WORLD_SIZES:
        return None
    if int(resolved(server_args, "nnodes") or 1) != 1:
        return None
    step = int(resolved(server_args, "gpu_id_step") or 1)
    gpus = [int(resolved(server_args, "base_gpu_id") or 0) + r * step for r in range(tp)]
    if settings.mode == "auto":
        capabilities = _capabilities(gpus)
        if capabilities is None or any(c != SM120 for c in capabilities):
            logger.info("sglang_sm120: no tune at launch: mode auto and the GPUs are not all capability 12.0 "
                        "(%s)", capabilities or "unknown")
            return None
    try:
        hidden = config.hidden_from_model(server_args.model_path)
    except SystemExit as exc:  # the tool's one-line error; here the launch must go on
        logger.warning("sglang_sm120: no tune at launch: %s", str(exc).removeprefix("error: "))
        return None
    draft = int(resolved(server_args, "speculative_num_draft_tokens") or 1) \
        if resolved(server_args, "speculative_algorithm") else 1
    batches = resolved(server_args, "cuda_graph_bs", "cuda_graph_bs_decode") or []
    max_batch = int(resolved(server_args, "cuda_graph_max_bs", "cuda_graph_max_bs_decode") or max(batches, default=32))
    bound = config.derive_max_bytes(hidden_size=hidden, element_size=ELEMENT_BYTES, cuda_graph_max_bs=max_batch,
                                    cuda_graph_bs=list(batches), speculative_num_draft_tokens=draft,
                                    speculative_algorithm="on" if draft > 1 else None)
    max_bytes = settings.max_bytes or bound.max_bytes
    dtype = "fp16" if str(resolved(server_args, "dtype")) in ("float16", "half") else "bf16"
    command = [sys.executable, "-m", "sglang_sm120.tune", "--tp", str(tp), "--gpus", ",".join(map(str, gpus)),
               "--hidden", str(hidden), "--dtype", dtype,
               "--max-rows", str(max(1, max_bytes // (hidden * ELEMENT_BYTES))),
               "--max-batch", str(max_batch), "--draft-tokens", str(draft), "--quick",
               "--timeout", str(settings.tune_timeout_s), "--server-env"]
    if batches and not resolved(server_args, "disable_cuda_graph"):  # an eager server captures no size
        command += ["--cuda-graph-bs", ",".join(map(str, batches))]
    return command + ([] if settings.tune == "force" else ["--if-missing"])


def tune_before_ranks(server_args) -> int | None:
    """Run the tool for this server (when due); its exit code, None when it did not run."""
    settings = config.settings_of(server_args)
    command = tune_command(server_args, settings)
    if command is None:
        return None
    print(f"sglang_sm120: routing table for this box (--sm120-allreduce-tune {settings.tune}): "
          f"{' '.join(command[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    tool = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    try:
        code = tool.wait(timeout=settings.tune_timeout_s + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        code = end_tool(tool)
    except BaseException:  # the launch itself is stopping (Ctrl-C): the tool and its ranks go with it
        end_tool(tool)
        raise
    if code != 0:
        logger.warning("sglang_sm120: the tune at launch failed (exit code %s after %.0f s, output above); the "
                       "ranks will find no table of this box and send every size to NCCL", code,
                       time.monotonic() - start)
    return code


def end_tool(tool: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL, to the tool's process group; its rank processes die with it (tuning/child.py)."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(tool.pid, sig)
        except ProcessLookupError:
            break
        try:
            tool.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    return -1


def wrap_set_envs_and_config(original):
    """engine._set_envs_and_config: in the launcher, after the server arguments are final and SGLang's own
    NCCL variables are set (the table's key holds them), before any rank starts."""

    @functools.wraps(original)
    def _set_envs_and_config(server_args, *args, **kwargs):
        result = original(server_args, *args, **kwargs)
        try:
            tune_before_ranks(server_args)
        except Exception:
            logger.exception("sglang_sm120: the tune at launch could not run; the ranks route by a table if one "
                             "exists, else every size goes to NCCL")
        return result

    return _set_envs_and_config
