"""Every overlay setting, parsed here and nowhere else into one `OverlaySettings`, and the byte bound.

Parsed when SGLang makes its ServerArgs record: the environment first (`sglang.Engine(**kwargs)` bypasses argparse),
the flags over it. The record carries the settings to every scheduler process (SGLang pickles it; `settings_of`).
The kernel package's switches are checked on the way, so a bad value of either family stops the launch in one line.
Each variable is read by the kernel package's one reader (both spellings, SGL_ and SGLANG_) and parsed by its
parsers, so every error has one form: `NAME='value': what is allowed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping

from sgl_kernel_sm120 import settings as kernel_settings
from sgl_kernel_sm120.settings import SettingError, choice, count, lookup, seconds

MODE_ENV = "SGLANG_SM120_ALLREDUCE"
MAX_BYTES_ENV = "SGLANG_SM120_ALLREDUCE_MAX_BYTES"
TUNE_ENV = "SGLANG_SM120_ALLREDUCE_TUNE"
TUNE_TIMEOUT_ENV = "SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S"
AGREEMENT_TIMEOUT_ENV = "SGLANG_SM120_ALLREDUCE_AGREEMENT_TIMEOUT_S"
HOSTMEM_ENV = "SGLANG_SM120_HOSTMEM"

MODES = ("auto", "on", "off")
TUNE_MODES = ("auto", "off", "force")
HOSTMEM_CHOICES = ("auto", "off")
MAX_SECONDS = 3600.0
SETTINGS_ATTR = "sm120_settings"  # the ServerArgs attribute that carries the parsed settings

# Past a few MiB NCCL's ring is as fast on PCIe, and every GPU's scratch (about 2 x TP x bound) grows with the bound.
DERIVED_MAX_BYTES_CAP = 8 << 20
MAX_EXPLICIT_BYTES = 64 << 20
VECTOR_BYTES = 16  # the kernels move whole 16-byte vectors: a workspace's size is a multiple of it
MIN_MAX_BYTES = VECTOR_BYTES
FALLBACK_MAX_TOKENS = 64  # when the server captures no CUDA graph

__all__ = ["SettingError"]

parse_mode = choice(MODES)
parse_tune = choice(TUNE_MODES, "auto: tune at launch when no table of this box exists; off: the built-in seeds; "
                    "force: tune at every launch")
parse_hostmem = choice(HOSTMEM_CHOICES, "auto: use pinned host memory where CUDA P2P is missing; off: stay on NCCL "
                       "there")
parse_seconds = seconds(most=MAX_SECONDS)
_byte_count = count(MIN_MAX_BYTES, MAX_EXPLICIT_BYTES, what="a byte count",
                    also="or auto (derived from the captured batch sizes)")


def parse_max_bytes(name: str, raw: object) -> int | None:
    """A byte count in [MIN_MAX_BYTES, MAX_EXPLICIT_BYTES], or None ("auto" or empty: derive it). A count that is
    not a whole number of vectors is kept here and rounded down by resolve_max_bytes, which says so."""
    if raw is None or str(raw).strip().lower() in ("", "auto"):
        return None
    return _byte_count(name, raw)


@dataclasses.dataclass(frozen=True)
class OverlaySettings:
    mode: str = "auto"
    max_bytes: int | None = None  # None: derived from the model and the captured batch sizes
    tune: str = "auto"
    hostmem: str = "auto"
    agreement_timeout_s: float = 60.0  # every cross-rank agreement of the backend
    tune_timeout_s: float = 180.0  # the launcher's tune, when it runs


# (field, variable, parser); the README's settings table lists the same variables.
ENVIRONMENT = (
    ("mode", MODE_ENV, parse_mode),
    ("max_bytes", MAX_BYTES_ENV, parse_max_bytes),
    ("tune", TUNE_ENV, parse_tune),
    ("hostmem", HOSTMEM_ENV, parse_hostmem),
    ("agreement_timeout_s", AGREEMENT_TIMEOUT_ENV, parse_seconds),
    ("tune_timeout_s", TUNE_TIMEOUT_ENV, parse_seconds),
)
# (field, flag, parser, choices or metavar, help); argparse's destination is the flag in snake case.
FLAGS = (
    ("mode", "--sm120-allreduce", parse_mode, MODES,
     "Serve small tensor-parallel all-reduces and the fused all-reduce + residual-add + RMSNorm with "
     "sgl_kernel_sm120's CUDA IPC kernels. auto (default): when every TP GPU is compute capability 12.0, TP 2/4/8 on "
     f"one node, deterministic inference off; on: any CUDA GPU; off: SGLang unchanged. Env: {MODE_ENV}."),
    ("max_bytes", "--sm120-allreduce-max-bytes", parse_max_bytes, "N",
     f"Largest all-reduce (bytes, rounded down to a multiple of {VECTOR_BYTES}) the kernels may serve; larger ones "
     "stay on NCCL. Default: the widest captured decode/verify batch x hidden x element size, at most "
     f"{DERIVED_MAX_BYTES_CAP}. Env: {MAX_BYTES_ENV}."),
    ("tune", "--sm120-allreduce-tune", parse_tune, TUNE_MODES,
     "Each size goes to the kernels only where this box's routing table (python -m sglang_sm120.tune) measured them "
     "faster than NCCL. auto (default): when no table matches, the launcher runs a quick tune before the ranks start "
     "(a failure leaves every size on NCCL); off: no tuning, a missing table means the unmeasured seeds; force: tune "
     f"at every launch. Env: {TUNE_ENV}."),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def settings_from_environment(environ: Mapping[str, str] | None = None) -> OverlaySettings:
    """The settings from the environment, the kernel package's switches checked too; SettingError names the first
    bad variable."""
    kernel_settings.read(environ)
    return OverlaySettings(**{field: parse(*found) for field, name, parse in ENVIRONMENT
                              if (found := lookup(name, environ)) is not None})


def with_flags(settings: OverlaySettings, namespace: object) -> OverlaySettings:
    """`settings` with the flags argparse parsed (SettingAction checked each value)."""
    given = {field: getattr(namespace, _dest(flag)) for field, flag, *_ in FLAGS
             if getattr(namespace, _dest(flag), None) is not None}
    return dataclasses.replace(settings, **given)


def settings_of(server_args: object | None, environ: Mapping[str, str] | None = None) -> OverlaySettings:
    """The settings stored on a ServerArgs record; else (a record rebuilt from its fields, as 0.5.13.post1's Ray
    launcher does, or none) this process's environment."""
    stored = getattr(server_args, SETTINGS_ATTR, None)
    return stored if isinstance(stored, OverlaySettings) else settings_from_environment(environ)


def kernel_timeout_s(server_args: object | None, environ: Mapping[str, str] | None = None) -> float | None:
    """The kernels' wait bound: None when the kernel switch is set (the package reads it) or nothing is known, else
    SGLang's --dist-timeout (what NCCL would wait for a late peer)."""
    if "timeout_s" in kernel_settings.read(environ).given:
        return None
    dist_timeout = getattr(server_args, "dist_timeout", None)
    if isinstance(dist_timeout, int | float) and not isinstance(dist_timeout, bool) and dist_timeout > 0:
        return float(dist_timeout)
    return None


class SettingAction(argparse.Action):
    """Parses a flag with a parser of the kernel package's family (`parse(name, value)`). A bad value ends the
    command with one line (exit 2), not SGLang's whole usage; a parser built with exit_on_error=False gets an
    ArgumentError."""

    def __init__(self, option_strings, dest, parse=None, **kwargs):
        self.parse = parse
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.parse(option_string or self.option_strings[0], values)
        except SettingError as exc:
            if getattr(parser, "exit_on_error", True):
                parser.exit(2, f"error: argument {'/'.join(self.option_strings)}: {exc}\n")
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, value)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds the overlay's flags to SGLang's server parser (once)."""
    if any("--sm120-allreduce" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group("sglang-sm120 (CUDA IPC all-reduce for RTX PRO 6000 / SM120)")
    for _, flag, parse, meta, text in FLAGS:
        group.add_argument(flag, dest=_dest(flag), action=SettingAction, parse=parse, default=None, help=text,
                           metavar=meta if isinstance(meta, str) else "{" + ",".join(meta) + "}")


@dataclasses.dataclass(frozen=True)
class ByteBound:
    max_bytes: int
    explanation: str


def derive_max_bytes(*, hidden_size: int, element_size: int, cuda_graph_max_bs: int | None = None,
                     cuda_graph_bs: list[int] | None = None, speculative_num_draft_tokens: int | None = None,
                     speculative_algorithm: str | None = None, decode_rows: int | None = None) -> ByteBound:
    """The default bound: the largest tensor a captured decode or EAGLE verify step all-reduces
    (`[batch x draft tokens, hidden]`); bigger batches run eagerly and are prefill-like, where NCCL is fine."""
    sizes = [bs for bs in (cuda_graph_bs or []) if isinstance(bs, int) and bs > 0]
    if cuda_graph_max_bs:
        sizes.append(int(cuda_graph_max_bs))
    per_request = max(1, int(speculative_num_draft_tokens)) if speculative_algorithm and \
        speculative_num_draft_tokens else 1
    if decode_rows:  # SGLang 0.5.23 counts the rows itself (draft tokens included)
        tokens, why = int(decode_rows), f"widest captured decode/verify reduction {int(decode_rows)} rows"
    elif sizes:
        tokens, why = max(sizes) * per_request, f"max CUDA-graph batch {max(sizes)} x {per_request} token(s)"
    else:
        tokens, why = FALLBACK_MAX_TOKENS, f"no CUDA-graph batch size known, assuming {FALLBACK_MAX_TOKENS} tokens"
    row = int(hidden_size) * int(element_size)
    raw = tokens * row
    why += f" x hidden {hidden_size} x {element_size} B = {raw} B"
    if raw > DERIVED_MAX_BYTES_CAP:  # whole rows, so the fused token bound stays exact
        capped = max(row, DERIVED_MAX_BYTES_CAP // row * row)
        return ByteBound(capped, why + f", capped to {capped} B")
    return ByteBound(raw, why)


def server_arg(server_args, *names):
    """The first of `names` the record sets (0.5.23 renamed the decode graph fields: cuda_graph_bs_decode...)."""
    return next((getattr(server_args, n) for n in names if getattr(server_args, n, None)), None)


def resolve_max_bytes(explicit: int | None, server_args: object | None, hidden_size: int, element_size: int,
                      decode_rows: int | None = None) -> ByteBound:
    if explicit is not None:
        whole = int(explicit) // VECTOR_BYTES * VECTOR_BYTES
        said = "" if whole == explicit else f", rounded down from {explicit} B to whole {VECTOR_BYTES}-byte vectors"
        return ByteBound(whole, f"set explicitly (--sm120-allreduce-max-bytes / {MAX_BYTES_ENV}){said}")
    return derive_max_bytes(
        hidden_size=hidden_size, element_size=element_size, decode_rows=decode_rows,
        cuda_graph_max_bs=server_arg(server_args, "cuda_graph_max_bs", "cuda_graph_max_bs_decode"),
        cuda_graph_bs=server_arg(server_args, "cuda_graph_bs", "cuda_graph_bs_decode"),
        speculative_num_draft_tokens=getattr(server_args, "speculative_num_draft_tokens", None),
        speculative_algorithm=getattr(server_args, "speculative_algorithm", None))


def hidden_from_config(config: dict) -> int | None:
    """hidden_size of a HF config.json, at the top or in the text model's section (multimodal models)."""
    sections = [config] + [config.get(k) for k in ("text_config", "language_config", "llm_config", "language_model")]
    found = [s["hidden_size"] for s in sections if isinstance(s, dict) and isinstance(s.get("hidden_size"), int)]
    return int(found[0]) if found else None


def hidden_from_model(model_path: str) -> int:
    """The hidden size of a local model folder or a Hugging Face repo id (its config.json)."""
    path = os.path.join(model_path, "config.json")
    try:
        if not os.path.isdir(model_path):
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model_path, "config.json")
    except Exception as exc:
        raise SystemExit(f"error: cannot read config.json of {model_path!r} ({type(exc).__name__}: {exc}); "
                         "pass --hidden") from None
    try:
        with open(path, encoding="utf-8") as handle:
            hidden = hidden_from_config(json.load(handle))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read {path} ({exc}); pass --hidden") from None
    if hidden is None:
        raise SystemExit(f"error: {path} names no hidden_size; pass --hidden")
    return hidden
