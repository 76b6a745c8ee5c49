"""Replacements for ServerArgs seams: the flags, and how the settings reach every process (docs/overlay.md's seam
tables say what each replacement does).

The settings are parsed once (core/config.py) into one OverlaySettings stored on the ServerArgs record, which
SGLang pickles to every scheduler process (0.5.13.post1: the dataclass's __dict__; 0.5.23: its __reduce__ passes
__dict__ along). Nothing is written into the environment.
"""

from __future__ import annotations

import functools
import logging
import sys

from ..core import config

logger = logging.getLogger("sglang_sm120")

FUSION_FIELD = "flashinfer_allreduce_fusion_backend"  # 0.5.23's resolved switch


def _device_capability() -> tuple[int, int] | None:
    """The GPU's capability as SGLang reads it (0.5.23 asks NVML: a CUDA context in the launcher poisons the
    scheduler processes it forks)."""
    try:
        from sglang.srt.utils.common import get_device_sm

        sm = int(get_device_sm())
    except Exception:
        return None
    return (sm // 10, sm % 10) if sm > 0 else None


def _fusion_must_go(server_args, requested: bool, capability, what: str) -> bool:
    """FlashInfer's all-reduce fusion, if `requested`, has no kernels on SM12x (its JIT stops, or the warm-up
    raises): True, with a warning, where it must go off, unless the overlay is off."""
    if config.settings_of(server_args).mode == "off" or not requested:
        return False
    capability = _device_capability() if capability is None else capability
    if capability is None or capability[0] != 12:
        return False
    logger.warning("sglang_sm120: FlashInfer all-reduce fusion%s has no kernels for compute capability %d.%d; turned "
                   "it off (the sm120 backend provides the fused all-reduce + RMSNorm)", what, *capability)
    return True


def keep_flashinfer_fusion_off_on_sm120(server_args, capability: tuple[int, int] | None = None) -> bool:
    """0.5.13.post1 (enabling the fusion would also make the pre-capture hook build its workspace). True if it
    switched the flag off."""
    if not _fusion_must_go(server_args, getattr(server_args, "enable_flashinfer_allreduce_fusion", False), capability,
                           ""):
        return False
    server_args.enable_flashinfer_allreduce_fusion = False
    return True


def wrap_add_cli_args(original):
    func = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(func)
    def add_cli_args(parser):
        func(parser)
        config.add_cli_args(parser)

    return staticmethod(add_cli_args)


def exit_on_setting_error(check):
    """`check()`; a SettingError ends the command-line launch with its one line (exit code 2, as argparse does for
    a bad flag) instead of a traceback from deep inside SGLang's setup."""
    try:
        return check()
    except config.SettingError as exc:
        print(f"error: sglang_sm120: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def wrap_from_cli_args(original):
    func = original.__func__ if isinstance(original, classmethod) else original

    @functools.wraps(func)
    def from_cli_args(cls, args):
        # 0.5.13.post1 builds the record here, its __post_init__ (ours first) storing the environment's settings;
        # 0.5.23 only builds it (resolution comes later).
        server_args = exit_on_setting_error(lambda: func(cls, args))
        stored = getattr(server_args, config.SETTINGS_ATTR, None)
        if not isinstance(stored, config.OverlaySettings):
            stored = exit_on_setting_error(config.settings_from_environment)
        setattr(server_args, config.SETTINGS_ATTR, config.with_flags(stored, args))
        keep_flashinfer_fusion_off_on_sm120(server_args)
        return server_args

    return classmethod(from_cli_args)


def wrap_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        settings = config.settings_from_environment()  # before SGLang's own checks: a typo raises at once
        original(self)
        setattr(self, config.SETTINGS_ATTR, settings)
        keep_flashinfer_fusion_off_on_sm120(self)

    return __post_init__


# ---------------------------------------------------------------------------------------------------------
# SGLang 0.5.23


class RunsFirst:
    """A method replacement that does its work when the method is looked up (`record.resolve_once`) and hands back
    SGLang's own bound method for the caller to call: no frame of ours is on the stack while SGLang resolves, so
    its errors (a bad argument, a missing model) show its frames only. Called through the class, it runs both."""

    def __init__(self, original, first):
        functools.update_wrapper(self, original)
        self.original, self.first = original, first

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        self.first(instance)
        return self.original.__get__(instance, owner)

    def __call__(self, instance, *args, **kwargs):
        return self.__get__(instance, type(instance))(*args, **kwargs)


def _fill_unless_sealed(server_args) -> None:
    # A record made without argparse (`sglang.Engine(**kwargs)`) gets the environment's settings before resolution
    # seals it; a finished (or failed) record is sealed and the original returns early.
    if getattr(server_args, "_resolution_finished", False) or getattr(server_args, "_resolution_failed", False):
        return
    if not isinstance(getattr(server_args, config.SETTINGS_ATTR, None), config.OverlaySettings):
        setattr(server_args, config.SETTINGS_ATTR, config.settings_from_environment())


def wrap_resolve_once(original):
    return RunsFirst(original, _fill_unless_sealed)


def keep_flashinfer_fusion_off_on_sm12x(server_args, capability: tuple[int, int] | None = None) -> bool:
    """Declare `flashinfer_allreduce_fusion_backend=None` (any value makes the warm-up raise on SM12x). True if it
    did. Runs during resolution: a published record refuses declarations."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result

    requested = resolution_result(server_args, FUSION_FIELD)
    if not _fusion_must_go(server_args, requested is not None, capability, f" (backend {requested!r})"):
        return False
    declare_resolution(server_args, "sglang_sm120", **{FUSION_FIELD: None})
    return True


def wrap_handle_model_specific_adjustments(original):
    # The step that holds SGLang's own auto-enable and enforce-disable passes; nothing later turns it back on.
    # functools.wraps keeps __name__, which SGLang's run_hook uses to find plugin overrides of this step.
    @functools.wraps(original)
    def handle_model_specific_adjustments(server_args):
        original(server_args)
        keep_flashinfer_fusion_off_on_sm12x(server_args)

    return handle_model_specific_adjustments
