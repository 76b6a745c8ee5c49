"""Replacements for ServerArgs seams: the three flags, and how their values reach every process.

Every setting is parsed once, into one config.OverlaySettings stored on the ServerArgs record
(config.SETTINGS_ATTR): SGLang hands the record to every scheduler process by pickling it (multiprocessing's
spawn), and the pickle carries the record's instance attributes (0.5.13.post1: the dataclass's __dict__;
0.5.23: its __reduce__ passes __dict__ along), so the hooks there read the settings the launcher parsed.
Nothing is written into the environment.
- `add_cli_args` (staticmethod): adds the flags, so they show in `--help` (argparse parses each value once).
- `__post_init__`: the environment's settings (a bad value raises `config.SettingError` here, before SGLang's
  own checks), stored on the record; this alone serves `sglang.Engine(**kwargs)`, which bypasses argparse; and
  keeps FlashInfer's TRT-LLM all-reduce fusion off on SM120.
- `from_cli_args` (classmethod): lays the flags over the environment's settings (those `__post_init__` stored,
  or, where it has none, 0.5.23, parsed here); a bad variable ends the launch with one line naming it, like
  argparse's own errors, instead of a traceback.

SGLang 0.5.23 changed this concern; its seam table (seams/v0_5_23.py) uses the hooks of the last section:
- ServerArgs is a msgspec struct whose `__post_init__` does nothing, and msgspec binds that hook when the
  class is built, so replacing it later never runs. Resolution is `resolve_once()`, called once by the
  launcher / Engine (the pickled copy in each scheduler carries `_resolution_finished` and returns early).
  Non-underscore attributes can be set only before it: after, the record is sealed. So the environment
  (the `sglang.Engine(**kwargs)` path) is read in a `resolve_once` wrapper, before the original runs.
- FlashInfer's fusion is a resolved field (`flashinfer_allreduce_fusion_backend`); on SM12x any value makes
  the warm-up raise (FlashInfer's backend resolution accepts SM90/SM100 only). Resolution steps may not write
  fields; they declare decisions. The declaration goes right after `handle_model_specific_adjustments`,
  the step that holds SGLang's own auto-enable and enforce-disable passes; nothing later turns it back on.
"""

from __future__ import annotations

import functools
import logging
import sys

from ..core import config

logger = logging.getLogger("sglang_sm120")


def _local_capability() -> tuple[int, int] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability())
    except Exception:
        pass
    return None


def keep_flashinfer_fusion_off_on_sm120(server_args, capability: tuple[int, int] | None = None) -> bool:
    """FlashInfer's TRT-LLM fusion has no SM12x kernels (its JIT stops with "No supported CUDA architectures
    found for major versions [9, 10]"), and enabling it would make the pre-capture hook build its workspace.
    Returns True if it switched the flag off."""
    if config.settings_of(server_args).mode == "off":
        return False
    if not getattr(server_args, "enable_flashinfer_allreduce_fusion", False):
        return False
    capability = _local_capability() if capability is None else capability
    if capability is None or capability[0] != 12:
        return False
    server_args.enable_flashinfer_allreduce_fusion = False
    logger.warning(
        "sglang_sm120: FlashInfer all-reduce fusion has no kernels for compute capability %d.%d; turned it off "
        "(the sm120 backend provides the fused all-reduce + RMSNorm)", *capability,
    )
    return True


def store_settings(server_args, settings: config.OverlaySettings) -> None:
    setattr(server_args, config.SETTINGS_ATTR, settings)


def wrap_add_cli_args(original):
    func = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(func)
    def add_cli_args(parser):
        func(parser)
        config.add_cli_args(parser)

    return staticmethod(add_cli_args)


def exit_on_setting_error(check):
    """Run `check` and return what it returns; on a SettingError end the command-line launch with its one-line
    message (exit code 2, as argparse does for a bad flag) instead of a traceback from deep inside SGLang's setup."""
    try:
        return check()
    except config.SettingError as exc:
        print(f"error: sglang_sm120: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def wrap_from_cli_args(original):
    func = original.__func__ if isinstance(original, classmethod) else original

    @functools.wraps(func)
    def from_cli_args(cls, args):
        # 0.5.13.post1: SGLang's from_cli_args builds the record, whose __post_init__ (ours first) parses and
        # stores the environment's settings; 0.5.23 only builds the record here (resolution comes later).
        server_args = exit_on_setting_error(lambda: func(cls, args))
        stored = getattr(server_args, config.SETTINGS_ATTR, None)
        if not isinstance(stored, config.OverlaySettings):
            stored = exit_on_setting_error(config.settings_from_environment)
        store_settings(server_args, config.with_flags(stored, args))
        keep_flashinfer_fusion_off_on_sm120(server_args)
        return server_args

    return classmethod(from_cli_args)


def wrap_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        # Before SGLang's own checks (which need a GPU and take time): a typo in a variable raises at once.
        settings = config.settings_from_environment()
        original(self)
        store_settings(self, settings)
        keep_flashinfer_fusion_off_on_sm120(self)

    return __post_init__


# ---------------------------------------------------------------------------------------------------------
# SGLang 0.5.23: a msgspec ServerArgs, resolved once by a pipeline of steps

FUSION_FIELD = "flashinfer_allreduce_fusion_backend"
DECLARATION_SOURCE = "sglang_sm120"


# ---------------------------------------------------------------------------------------------------------
# server arguments


def fill_settings_from_env(server_args) -> None:
    """A record made without argparse (`sglang.Engine(**kwargs)`) gets the environment's settings. Invalid values
    raise here, naming the variable, before SGLang starts anything."""
    if not isinstance(getattr(server_args, config.SETTINGS_ATTR, None), config.OverlaySettings):
        store_settings(server_args, config.settings_from_environment())


class RunsFirst:
    """A method replacement that does its work when the method is looked up (`record.resolve_once`) and hands
    back SGLang's own bound method, which the caller then calls itself. A wrapper function would still be on the
    stack while the original runs, so every error SGLang raises there (a bad argument, a missing model) would
    show a frame of ours and invite the blame; this shows SGLang's frames only. Called through the class
    (`ServerArgs.resolve_once(record)`), it runs both steps itself."""

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
    # A finished (or failed) record is sealed; the early return of the original is what runs then.
    if not getattr(server_args, "_resolution_finished", False) and not getattr(server_args, "_resolution_failed",
                                                                               False):
        fill_settings_from_env(server_args)


def wrap_resolve_once(original):
    return RunsFirst(original, _fill_unless_sealed)


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

    if config.settings_of(server_args).mode == "off":
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
