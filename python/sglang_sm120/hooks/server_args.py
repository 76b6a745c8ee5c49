"""Replacements for ServerArgs seams: the two flags, and how their values reach every process.

- `add_cli_args` (staticmethod): adds the flags, so they show in `--help`.
- `from_cli_args` (classmethod): checks the SGLANG_SM120_* environment before SGLang builds anything (a bad
  value ends the launch with one line naming it, like argparse's own errors), then copies the parsed values
  onto the instance and into the environment.
- `__post_init__`: checks the environment first for the same reason, then fills the values from it when the
  instance did not come from argparse (`sglang.Engine(**kwargs)`: a bad value raises `config.SettingError`
  there), and keeps FlashInfer's TRT-LLM all-reduce fusion off on SM120.

Instance attributes of the ServerArgs dataclass survive the pickling that hands it to scheduler processes;
the environment copy covers code that rebuilds ServerArgs from its fields (dataclasses.replace/asdict).
"""

from __future__ import annotations

import functools
import logging
import os
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
    if getattr(server_args, config.MODE_ATTR, "auto") == "off":
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


def store_settings(server_args, mode: str | None, max_bytes: int | None) -> None:
    if mode is not None:
        setattr(server_args, config.MODE_ATTR, config.parse_mode(mode, "--sm120-allreduce"))
    if max_bytes is not None:
        setattr(server_args, config.MAX_BYTES_ATTR, config.parse_max_bytes(max_bytes, "--sm120-allreduce-max-bytes"))


def wrap_add_cli_args(original):
    func = original.__func__ if isinstance(original, staticmethod) else original

    @functools.wraps(func)
    def add_cli_args(parser):
        func(parser)
        config.add_cli_args(parser)

    return staticmethod(add_cli_args)


def exit_on_setting_error(check) -> None:
    """Run `check`; on a SettingError end the command-line launch with its one-line message (exit code 2, as
    argparse does for a bad flag) instead of a traceback from deep inside SGLang's setup."""
    try:
        check()
    except config.SettingError as exc:
        print(f"error: sglang_sm120: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def wrap_from_cli_args(original):
    func = original.__func__ if isinstance(original, classmethod) else original

    @functools.wraps(func)
    def from_cli_args(cls, args):
        exit_on_setting_error(config.check_environment)
        server_args = func(cls, args)
        mode = getattr(args, config.MODE_ATTR, None)
        max_bytes = getattr(args, config.MAX_BYTES_ATTR, None)
        store_settings(server_args, mode, max_bytes)
        # Processes started later (schedulers, detokenizer) inherit the environment.
        if mode is not None:
            os.environ[config.MODE_ENV] = getattr(server_args, config.MODE_ATTR)
        if max_bytes is not None:
            os.environ[config.MAX_BYTES_ENV] = str(getattr(server_args, config.MAX_BYTES_ATTR))
        keep_flashinfer_fusion_off_on_sm120(server_args)
        return server_args

    return classmethod(from_cli_args)


def wrap_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        # Before SGLang's own checks (which need a GPU and take time): a typo in a variable raises at once.
        config.check_environment()
        original(self)
        if getattr(self, config.MODE_ATTR, None) is None:
            setattr(self, config.MODE_ATTR, config.mode_from_env())
        if getattr(self, config.MAX_BYTES_ATTR, None) is None:
            setattr(self, config.MAX_BYTES_ATTR, config.max_bytes_from_env())
        keep_flashinfer_fusion_off_on_sm120(self)

    return __post_init__
