"""Settings of the overlay: the three server arguments, their environment equivalents, the environment-only
settings (agreement timeout, host-memory switch, tune timeout), and the byte bound.

`--sm120-allreduce {auto,on,off}`, `--sm120-allreduce-max-bytes N` and
`--sm120-allreduce-tune {auto,off,force}` are added to SGLang's parser by the server-args seam. Every setting is
parsed once, into one `OverlaySettings`, when the ServerArgs record is made: from the environment
(`settings_from_environment`; `sglang.Engine(**kwargs)` bypasses argparse and would reject unknown keyword
arguments, hence the variables), then the flags over it (`with_flags`; argparse parsed them with SettingAction).
The object is stored on the record (SETTINGS_ATTR), which SGLang pickles to every scheduler process (both
releases pickle the record's instance attributes with it), and the hooks read it there (`settings_of`). Nothing
is copied into the environment: a process that gets a record rebuilt from its fields alone (SGLang 0.5.13.post1's
Ray launcher does that) reads its own environment instead, so with Ray set the SGLANG_SM120_* variables.

Precedence: command line > environment > default. Everything here is pure Python and importable without
SGLang or a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sgl_kernel_sm120.env import setting

# The kernels' wait bound: read by sgl_kernel_sm120 itself when no value is passed.
from sgl_kernel_sm120.watchdog import TIMEOUT_ENV as KERNEL_TIMEOUT_ENV

MODE_ENV = "SGLANG_SM120_ALLREDUCE"
MAX_BYTES_ENV = "SGLANG_SM120_ALLREDUCE_MAX_BYTES"
# Bound, in seconds, of every collective step the overlay itself runs (gate agreement, pre-build barrier).
AGREEMENT_TIMEOUT_ENV = "SGLANG_SM120_ALLREDUCE_AGREEMENT_TIMEOUT_S"
# Whether a TP group without CUDA P2P between some pair (GeForce cards, a pair the driver does not connect, or
# one whose P2P writes the construction probe saw dropped) may use the pinned host-memory workspace ("auto",
# the default) or stays on NCCL ("off"). Independent of the mode.
HOSTMEM_ENV = "SGLANG_SM120_HOSTMEM"
HOSTMEM_CHOICES = ("auto", "off")
DEFAULT_HOSTMEM = "auto"

MODES = ("auto", "on", "off")
DEFAULT_MODE = "auto"
# What a server does when no routing table of this box covers it (a table that does is always used, unless
# "force"): "auto" runs the quick tune before CUDA-graph capture and caches it, "off" routes by the unmeasured
# seeds, "force" tunes again even when a table exists. A tune that fails sends every size to NCCL.
TUNE_ENV = "SGLANG_SM120_ALLREDUCE_TUNE"
TUNE_MODES = ("auto", "off", "force")
DEFAULT_TUNE = "auto"
# Bound, in seconds, of the quick tune at server start (its child processes are killed after it: NCCL then).
TUNE_TIMEOUT_ENV = "SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S"
DEFAULT_TUNE_TIMEOUT_S = 180.0
DEFAULT_AGREEMENT_TIMEOUT_S = 60.0
MAX_AGREEMENT_TIMEOUT_S = 3600.0

# The argparse destinations of the three flags, and the attribute of ServerArgs records that holds the settings.
MODE_ATTR = "sm120_allreduce"
MAX_BYTES_ATTR = "sm120_allreduce_max_bytes"
TUNE_ATTR = "sm120_allreduce_tune"
SETTINGS_ATTR = "sm120_settings"

# The derived default is capped: past a few MiB NCCL's ring is as fast on PCIe and the IPC scratch
# (allocated on every rank) would grow with the largest CUDA-graph batch.
DERIVED_MAX_BYTES_CAP = 8 << 20
# An explicit bound is taken as given up to this cap: the scratch is about 2 x world x bound per GPU (1 GiB at
# TP=8), and NCCL is as fast as the IPC kernel well below it (16 MB crossover measured on 2x H200). Below
# MIN_MAX_BYTES not even one 16-byte vector fits.
MAX_EXPLICIT_BYTES = 64 << 20
MIN_MAX_BYTES = 16
# Used when the server arguments name no CUDA-graph batch size at all (e.g. CUDA graphs disabled).
FALLBACK_MAX_TOKENS = 64


class SettingError(ValueError):
    """A bad value of one of the overlay's flags or environment variables. Its text is one line that names the
    flag or variable, the value, and what is allowed, so launchers can print it without a traceback."""


def _parse_choice(value: object, source: str, choices, what: str, meaning: str = "") -> str:
    """One of `choices` (case and spaces ignored), or a SettingError naming the setting, the value and the
    choices (with what each means, when given)."""
    text = str(value).strip().lower()
    if text not in choices:
        raise SettingError(f"{source}={value!r} is not a valid {what}; allowed: {', '.join(choices)}"
                           + (f" ({meaning})" if meaning else ""))
    return text


def parse_mode(value: object, source: str) -> str:
    return _parse_choice(value, source, MODES, "mode")


def parse_tune(value: object, source: str) -> str:
    return _parse_choice(value, source, TUNE_MODES, "tune setting", "auto: measure at start-up when no table of this "
                         "box exists; off: the built-in seeds; force: measure at every start")


def parse_max_bytes(value: object, source: str) -> int | None:
    """A byte count in [MIN_MAX_BYTES, MAX_EXPLICIT_BYTES], or None for "derive it" (None, "", "auto")."""
    allowed = (
        f"allowed: an integer byte count from {MIN_MAX_BYTES} to {MAX_EXPLICIT_BYTES} ({MAX_EXPLICIT_BYTES >> 20} MiB; "
        "the IPC scratch on every GPU is about 2 x TP size x this bound), or 'auto' to derive it"
    )
    if value is None:
        return None
    number = value
    if isinstance(value, str):
        text = value.strip()
        if text == "" or text.lower() == "auto":
            return None
        try:
            number = int(text, 0)
        except ValueError:
            raise SettingError(f"{source}={value!r} is not an integer; {allowed}") from None
    if isinstance(number, bool) or not isinstance(number, int):
        raise SettingError(f"{source}={value!r} is not an integer; {allowed}")
    if not MIN_MAX_BYTES <= number <= MAX_EXPLICIT_BYTES:
        raise SettingError(f"{source}={value!r} is out of range; {allowed}")
    return number


def parse_hostmem(value: object, source: str) -> str:
    return _parse_choice(value, source, HOSTMEM_CHOICES, "host-memory setting",
                         "auto: use pinned host memory where CUDA P2P is missing; off: stay on NCCL there")


def parse_seconds(value: object, source: str) -> float:
    """A bound of one of the overlay's steps, in seconds: above 0, at most MAX_AGREEMENT_TIMEOUT_S."""
    allowed = f"allowed: seconds, a number above 0 and at most {MAX_AGREEMENT_TIMEOUT_S:.0f}"
    try:
        seconds = float(value)
    except ValueError:
        raise SettingError(f"{source}={value!r} is not a number; {allowed}") from None
    if not 0 < seconds <= MAX_AGREEMENT_TIMEOUT_S:  # also rejects nan
        raise SettingError(f"{source}={value!r} is out of range; {allowed}")
    return seconds


@dataclass(frozen=True)
class OverlaySettings:
    """Every setting of the overlay, parsed."""

    mode: str = DEFAULT_MODE
    max_bytes: int | None = None  # None: derive from the model and the CUDA-graph batch sizes
    tune: str = DEFAULT_TUNE
    hostmem: str = DEFAULT_HOSTMEM
    agreement_timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S
    tune_timeout_s: float = DEFAULT_TUNE_TIMEOUT_S


# (field, variable, parser) of every setting the environment can give.
ENVIRONMENT = (
    ("mode", MODE_ENV, parse_mode),
    ("max_bytes", MAX_BYTES_ENV, parse_max_bytes),
    ("tune", TUNE_ENV, parse_tune),
    ("hostmem", HOSTMEM_ENV, parse_hostmem),
    ("agreement_timeout_s", AGREEMENT_TIMEOUT_ENV, parse_seconds),
    ("tune_timeout_s", TUNE_TIMEOUT_ENV, parse_seconds),
)
# (field, argparse destination) of the flags.
FLAGS = (("mode", MODE_ATTR), ("max_bytes", MAX_BYTES_ATTR), ("tune", TUNE_ATTR))


def settings_from_environment(environ: Mapping[str, str] | None = None) -> OverlaySettings:
    """The settings the SGLANG_SM120_* variables give (unset or empty: the default). SettingError names the first
    bad one: called before SGLang's own setup, so a typo stops the launch at once."""
    environ = os.environ if environ is None else environ
    given = {}
    for field, name, parse in ENVIRONMENT:
        raw = environ.get(name)
        if raw not in (None, ""):
            given[field] = parse(raw, name)
    return OverlaySettings(**given)


def with_flags(settings: OverlaySettings, namespace: object) -> OverlaySettings:
    """`settings` with the flags the command line gave (argparse's namespace, whose values SettingAction parsed)."""
    given = {field: getattr(namespace, dest) for field, dest in FLAGS if getattr(namespace, dest, None) is not None}
    return dataclasses.replace(settings, **given)


def settings_of(server_args: object | None, environ: Mapping[str, str] | None = None) -> OverlaySettings:
    """The settings a process uses: those parsed when its ServerArgs record was made (stored on it), else, for a
    record rebuilt from its fields or no record at all, this process's environment."""
    stored = getattr(server_args, SETTINGS_ATTR, None) if server_args is not None else None
    return stored if isinstance(stored, OverlaySettings) else settings_from_environment(environ)


def kernel_timeout_s(server_args: object | None, environ: Mapping[str, str] | None = None) -> tuple[float | None, str]:
    """The bound of the kernels' spin-waits, and where it came from. SGL_SM120_AR_TIMEOUT_S wins (the kernel
    package reads it); else SGLang's `--dist-timeout`, the time NCCL would wait for a late peer; else None,
    the kernel package's default (minutes)."""
    environ = os.environ if environ is None else environ
    if setting(KERNEL_TIMEOUT_ENV, "", environ).strip():
        return None, KERNEL_TIMEOUT_ENV
    dist_timeout = getattr(server_args, "dist_timeout", None) if server_args is not None else None
    if isinstance(dist_timeout, int | float) and not isinstance(dist_timeout, bool) and dist_timeout > 0:
        return float(dist_timeout), "--dist-timeout"
    return None, "sgl_kernel_sm120 default"


class SettingAction(argparse.Action):
    """Parses a flag's value with one of the parsers above. A bad value ends the command with one line,
    `error: argument --flag: <why>`, exit code 2, instead of argparse's way of printing the whole usage first
    (483 lines for SGLang's server). A parser built with exit_on_error=False gets argparse's ArgumentError."""

    def __init__(self, option_strings, dest, parse=None, **kwargs):
        if parse is None:
            raise ValueError("SettingAction needs parse=")
        self.parse = parse
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.parse(values, option_string or self.option_strings[0])
        except SettingError as exc:
            if getattr(parser, "exit_on_error", True):
                parser.exit(2, f"error: argument {'/'.join(self.option_strings)}: {exc}\n")
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, value)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds the overlay's flags to SGLang's server parser (no-op if they are already there)."""
    if any("--sm120-allreduce" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group("sglang-sm120 (CUDA IPC all-reduce for RTX PRO 6000 / SM120)")
    group.add_argument(
        "--sm120-allreduce",
        dest=MODE_ATTR,
        action=SettingAction,
        parse=parse_mode,
        metavar="{" + ",".join(MODES) + "}",
        default=None,
        help=(
            "Route small tensor-parallel all-reduces (and the fused all-reduce + residual-add + RMSNorm) to "
            "sgl_kernel_sm120's CUDA IPC kernels. 'auto' (default): only when every TP rank's GPU is compute "
            "capability 12.0, TP size is 2/4/8 on one node and deterministic inference is off; the workspace "
            "is CUDA IPC over P2P, or pinned host memory where P2P is missing between a pair (GeForce cards; "
            f"{HOSTMEM_ENV}=off refuses that). 'on': on any CUDA GPU. 'off': SGLang unchanged. "
            f"Environment equivalent: {MODE_ENV}."
        ),
    )
    group.add_argument(
        "--sm120-allreduce-max-bytes",
        dest=MAX_BYTES_ATTR,
        action=SettingAction,
        parse=parse_max_bytes,
        default=None,
        metavar="N",
        help=(
            "Largest all-reduce (in bytes) sent to the sm120 kernel; larger ones stay on NCCL. Default: the "
            "largest captured decode/verify batch x speculative draft tokens x hidden size x element size "
            f"(capped at {DERIVED_MAX_BYTES_CAP} bytes); an explicit value may be {MIN_MAX_BYTES} to "
            f"{MAX_EXPLICIT_BYTES}, or 'auto'. Environment equivalent: {MAX_BYTES_ENV}."
        ),
    )
    group.add_argument(
        "--sm120-allreduce-tune",
        dest=TUNE_ATTR,
        action=SettingAction,
        parse=parse_tune,
        metavar="{" + ",".join(TUNE_MODES) + "}",
        default=None,
        help=(
            "Which sizes the sm120 kernels serve is decided by a routing table measured on this box (python -m "
            "sglang_sm120.tune), found in $SGLANG_SM120_CACHE by GPUs, driver, versions and topology; each size goes "
            "to the kernels only where they beat NCCL. Without a table: 'auto' (default) measures a quick one "
            "before CUDA-graph capture and caches it (any failure: every size on NCCL, with a warning naming the "
            "cause); 'off' measures nothing and runs the built-in seeds, unmeasured (every size within the bound "
            "to the kernels); 'force' measures at every start even when a table exists (a failure keeps that "
            f"table). Environment equivalent: {TUNE_ENV}."
        ),
    )


@dataclass(frozen=True)
class ByteBound:
    max_bytes: int
    explanation: str


def derive_max_bytes(
    *,
    hidden_size: int,
    element_size: int,
    cuda_graph_max_bs: int | None = None,
    cuda_graph_bs: list[int] | None = None,
    speculative_num_draft_tokens: int | None = None,
    speculative_algorithm: str | None = None,
    cap: int = DERIVED_MAX_BYTES_CAP,
    decode_rows: int | None = None,
) -> ByteBound:
    """The default dispatch bound: the largest tensor a captured decode or EAGLE verify step all-reduces.

    A captured decode step reduces `[bs, hidden]`; an EAGLE target-verify step `[bs * draft_tokens, hidden]`
    (draft-extend reduces the same count, draft decode `bs * topk` which is smaller). Bigger batches run
    eagerly and are prefill-like: NCCL handles them well.
    """
    sizes = [bs for bs in (cuda_graph_bs or []) if isinstance(bs, int) and bs > 0]
    if cuda_graph_max_bs:
        sizes.append(int(cuda_graph_max_bs))
    tokens_per_request = 1
    if speculative_algorithm and speculative_num_draft_tokens:
        tokens_per_request = max(1, int(speculative_num_draft_tokens))
    if decode_rows:
        # SGLang 0.5.23 computes the rows itself (draft tokens included, clamped to the request pool).
        tokens = int(decode_rows)
        why = f"widest captured decode/verify reduction {tokens} rows (SGLang's count)"
    elif sizes:
        max_bs = max(sizes)
        tokens = max_bs * tokens_per_request
        why = f"max CUDA-graph batch {max_bs} x {tokens_per_request} token(s) per request"
    else:
        tokens = FALLBACK_MAX_TOKENS
        why = f"no CUDA-graph batch size known, assuming {FALLBACK_MAX_TOKENS} tokens"
    row_bytes = int(hidden_size) * int(element_size)
    raw = tokens * row_bytes
    why += f" x hidden {hidden_size} x {element_size} B = {raw} B"
    if raw > cap:
        # Keep whole rows so the fused path's token bound stays exact.
        capped = max(row_bytes, cap // row_bytes * row_bytes)
        return ByteBound(capped, why + f", capped to {capped} B")
    return ByteBound(raw, why)


def resolve_max_bytes(
    explicit: int | None, server_args: object | None, hidden_size: int, element_size: int,
    decode_rows: int | None = None,
) -> ByteBound:
    if explicit is not None:
        return ByteBound(int(explicit), f"set explicitly ({MAX_BYTES_ATTR} / {MAX_BYTES_ENV})")
    return derive_max_bytes(
        hidden_size=hidden_size,
        element_size=element_size,
        decode_rows=decode_rows,
        cuda_graph_max_bs=getattr(server_args, "cuda_graph_max_bs", None),
        cuda_graph_bs=getattr(server_args, "cuda_graph_bs", None),
        speculative_num_draft_tokens=getattr(server_args, "speculative_num_draft_tokens", None),
        speculative_algorithm=getattr(server_args, "speculative_algorithm", None),
    )
