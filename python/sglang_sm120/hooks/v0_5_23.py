"""Replacements that only SGLang 0.5.23 needs (its seam table is seams/v0_5_23.py).

What changed from 0.5.13.post1, and why each hook looks the way it does:
- ServerArgs is a msgspec struct whose `__post_init__` does nothing, and msgspec binds that hook when the
  class is built, so replacing it later never runs. Resolution is `resolve_once()`, called once by the
  launcher / Engine (the pickled copy in each scheduler carries `_resolution_finished` and returns early).
  Non-underscore attributes can be set only before it: after, the record is sealed. So the environment
  (the `sglang.Engine(**kwargs)` path) is read in a `resolve_once` wrapper, before the original runs.
- FlashInfer's fusion is a resolved field (`flashinfer_allreduce_fusion_backend`); on SM12x any value makes
  the warm-up raise (FlashInfer's backend resolution accepts SM90/SM100 only). Resolution steps may not write
  fields; they declare decisions. The declaration goes right after `handle_model_specific_adjustments`,
  the step that holds SGLang's own auto-enable and enforce-disable passes; nothing later turns it back on.
- The pre-capture hook moved to `BaseRunner` (self is the runner), and the batch bound is SGLang's own row
  count `BaseRunner._widest_decode_rows()` (the old cuda_graph_max_bs / cuda_graph_bs fields are gone).
- `GroupCoordinator.__init__` also builds SGLang's own PCIe-IPC communicator when asked to; see
  upstream_pcie.py for why ours sets it aside.
"""

from __future__ import annotations

import functools
import logging

from ..core import config
from . import distributed as dist_hooks
from . import upstream_pcie

logger = logging.getLogger("sglang_sm120")

FUSION_FIELD = "flashinfer_allreduce_fusion_backend"
DECLARATION_SOURCE = "sglang_sm120"


# ---------------------------------------------------------------------------------------------------------
# server arguments


def fill_settings_from_env(server_args) -> None:
    """Values not set from the command line come from the environment. Invalid values raise here, naming
    the variable, before SGLang starts anything."""
    config.check_environment()
    if getattr(server_args, config.MODE_ATTR, None) is None:
        setattr(server_args, config.MODE_ATTR, config.mode_from_env())
    if getattr(server_args, config.MAX_BYTES_ATTR, None) is None:
        setattr(server_args, config.MAX_BYTES_ATTR, config.max_bytes_from_env())


def wrap_resolve_once(original):
    @functools.wraps(original)
    def resolve_once(self):
        # A finished (or failed) record is sealed; the early return of the original is what runs then.
        if not getattr(self, "_resolution_finished", False) and not getattr(self, "_resolution_failed", False):
            fill_settings_from_env(self)
        return original(self)

    return resolve_once


def _device_capability() -> tuple[int, int] | None:
    """The GPU's compute capability without creating a CUDA context (SGLang asks NVML first for the same
    reason: a context in the launcher poisons the scheduler processes it forks)."""
    try:
        from sglang.srt.utils.common import get_device_sm

        sm = int(get_device_sm())
    except Exception:
        return None
    return (sm // 10, sm % 10) if sm > 0 else None


def keep_flashinfer_fusion_off_on_sm12x(server_args, capability: tuple[int, int] | None = None) -> bool:
    """Declare `flashinfer_allreduce_fusion_backend=None` on SM12x unless the overlay is off. Returns True if
    it did. Must run during resolution (declarations are refused on a published record)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result

    mode = getattr(server_args, config.MODE_ATTR, None) or config.mode_from_env()
    if mode == "off":
        return False
    requested = resolution_result(server_args, FUSION_FIELD)
    if requested is None:
        return False
    capability = _device_capability() if capability is None else capability
    if capability is None or capability[0] != 12:
        return False
    declare_resolution(server_args, DECLARATION_SOURCE, **{FUSION_FIELD: None})
    logger.warning(
        "sglang_sm120: FlashInfer all-reduce fusion (backend %r) has no kernels for compute capability %d.%d "
        "and SGLang would stop at warm-up; turned it off (the sm120 backend provides the fused all-reduce + "
        "RMSNorm)", requested, *capability,
    )
    return True


def wrap_handle_model_specific_adjustments(original):
    # functools.wraps keeps __name__, which SGLang's run_hook uses to find plugin overrides of this step.
    @functools.wraps(original)
    def handle_model_specific_adjustments(server_args):
        original(server_args)
        keep_flashinfer_fusion_off_on_sm12x(server_args)

    return handle_model_specific_adjustments


# ---------------------------------------------------------------------------------------------------------
# distributed


def wrap_group_init(original):
    """The shared GroupCoordinator.__init__ hook (gate agreement for the TP group), then the coexistence rule
    with SGLang's PCIe-IPC all-reduce."""
    attach_init = dist_hooks.wrap_group_init(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        attach_init(self, *args, **kwargs)
        try:
            upstream_pcie.set_aside_upstream(self)
        except Exception:
            logger.exception("sglang_sm120 [%s]: deciding between SGLang's PCIe-IPC all-reduce and ours failed",
                             getattr(self, "unique_name", "?"))

    return __init__


def wrap_runner_pre_capture(original):
    """BaseRunner._pre_initialize_flashinfer_allreduce_workspace: runs once per model runner in its warm-up,
    before any CUDA graph of that runner is captured, on every rank, and before SGLang's own PCIe-IPC step."""

    @functools.wraps(original)
    def _pre_initialize_flashinfer_allreduce_workspace(self):
        result = original(self)
        model_runner = self.model_runner
        # The first build is final (captured graphs keep its pointers), so it is sized from the target
        # model's widest decode/verify reduction, never from a draft model's narrower one. The draft warms up
        # after the target; if it ever came first it would simply run on NCCL until the target builds.
        if getattr(model_runner, "is_draft_worker", False):
            return result
        failed = False
        try:
            dist_hooks.prepare_tp_backend(
                model_runner.server_args,
                int(model_runner.model_config.hidden_size),
                model_runner.dtype,
                decode_rows=self._widest_decode_rows(),
            )
        except Exception:
            failed = True  # same inputs on every rank, so every rank fails here together
            logger.exception("sglang_sm120: preparing the sm120 workspace failed; all-reduces stay on NCCL")
        try:
            from sglang.srt.distributed import parallel_state

            upstream_pcie.restore_upstream_if_ours_failed(parallel_state.get_tp_group(), failed=failed)
        except Exception:
            logger.exception("sglang_sm120: handing the TP group back to SGLang's PCIe-IPC all-reduce failed")
        return result

    return _pre_initialize_flashinfer_allreduce_workspace
