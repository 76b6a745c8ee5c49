"""Shared helpers of the benchmarks: distributed setup, CUDA-graph timing, agreement, norms, hardware, JSON.

Rules every benchmark here follows:
- Launched by torchrun; default group NCCL (device collectives), plus one dedicated gloo group for all host
  coordination (agreement, gathering timings) and one more for our IpcAllReduce.
- Every decision that can differ between ranks (an import failed, a kernel declined, a check mismatched) is
  first made locally, then *agreed* over gloo (``Dist.agree``) so that all ranks take the same branch before
  the next collective. A peer that fails is recorded as skipped, with the reasons of every rank.
- Timing is always of CUDA-graph replays: K calls captured back to back, R replays each timed with CUDA
  events; per-call time = replay time / K; per replay the MAX over ranks; reported: the MEDIAN over replays.
  Timings are gathered over gloo after the replays, never with NCCL between spinning kernels.

Pure helpers (no GPU needed) are at the top and covered by tests/test_bench_*.py.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1

# ---------------------------------------------------------------------------------------------------------
# Pure helpers


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA RTX PRO 6000 Blackwell Workstation Edition' -> 'rtx-pro-6000-...'."""
    s = name.strip().lower()
    s = re.sub(r"^nvidia\s+", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown-gpu"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1K' / '64KB' / '64KiB' -> 65536; '4M' -> 4 MiB; a bare integer is bytes (powers of 1024 throughout)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    val = float(m.group(1)) * mult
    if val != int(val) or val <= 0:
        raise ValueError(f"bad size {text!r}")
    return int(val)


def parse_int_list(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def format_bytes(n: int) -> str:
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    if n >= 1 << 10:
        return f"{n / 1024:.1f}KB"
    return f"{n}B"


def aggregate_iteration_times(per_rank: Sequence[Sequence[float]]) -> dict:
    """per_rank[r][i]: rank r's time of iteration i. Per iteration take the max over ranks (the collective is
    only done when its slowest rank is); report the median of those maxima, plus spread."""
    if not per_rank or not per_rank[0]:
        raise ValueError("no timings")
    n = len(per_rank[0])
    if any(len(r) != n for r in per_rank):
        raise ValueError("ranks report different iteration counts")
    worst = [max(r[i] for r in per_rank) for i in range(n)]
    srt = sorted(worst)

    def pct(p: float) -> float:
        return srt[min(n - 1, max(0, int(math.floor(p * (n - 1) + 0.5))))]

    return {
        "median_us": statistics.median(worst),
        "p10_us": pct(0.10),
        "p90_us": pct(0.90),
        "min_us": srt[0],
        "iters": n,
    }


def calls_per_replay(nbytes: int, base: int = 20) -> int:
    """K: calls captured per graph. Identical on all ranks (a function of the size only)."""
    if nbytes <= 1 << 20:
        return base
    if nbytes <= 8 << 20:
        return max(1, base // 2)
    return max(1, base // 5)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def write_json(path: Path, doc: dict) -> None:
    """Atomic write (tmp + rename), sorted keys off (keep our order), floats as-is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "name") and hasattr(o, "value"):  # enums
        return o.name
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def short_exc(e: BaseException, limit: int = 400) -> str:
    s = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def package_version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------------
# Plotting (matplotlib optional)


def plot_lines(
    path: Path,
    panels: Sequence[dict],
    *,
    title: str = "",
) -> str | None:
    """panels: [{"title", "xlabel", "ylabel", "logx", "logy", "series": {label: (xs, ys)}}].
    Returns None on success, else the reason the plot was not written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable: {short_exc(e)}"
    try:
        fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
        for ax, panel in zip(axes[0], panels, strict=False):
            for label, (xs, ys) in panel["series"].items():
                pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and x is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
            if panel.get("logx"):
                ax.set_xscale("log", base=2 if panel.get("logx") == 2 else 10)
            if panel.get("logy"):
                ax.set_yscale("log")
            ax.set_xlabel(panel.get("xlabel", ""))
            ax.set_ylabel(panel.get("ylabel", ""))
            ax.set_title(panel.get("title", ""), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return None
    except Exception as e:  # noqa: BLE001
        return f"plot failed: {short_exc(e)}"


# ---------------------------------------------------------------------------------------------------------
# Import paths: the repo root (``benchmarks``, ``sgl_kernel_sm120``) and ``python/`` (``sglang_sm120``)


def setup_import_paths() -> None:
    for p in (REPO_ROOT / "python", REPO_ROOT):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def install_sglang_standins() -> str | None:
    """On machines without real sgl_kernel/flashinfer wheels, SGLang needs the overlay's stand-ins to import.
    Returns None if installed (or not needed), else why not (never raises)."""
    setup_import_paths()
    try:
        from sglang_sm120.testing import standins  # type: ignore

        standins.install()
        return None
    except Exception as e:  # noqa: BLE001
        return short_exc(e)


# ---------------------------------------------------------------------------------------------------------
# Distributed


class NotEnoughGPUs(SystemExit):
    pass


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    gloo: Any  # ProcessGroup (gloo) for host-side coordination
    nccl: Any  # the default (NCCL) group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_obj(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.gloo)

    def agree(self, ok: bool, reason: str | None = None) -> tuple[bool, str | None]:
        """All ranks learn whether every rank succeeded; returns (all_ok, combined reason)."""
        votes = self.all_gather_obj((bool(ok), reason))
        if all(v[0] for v in votes):
            return True, None
        reasons: dict[str, list[int]] = {}
        for r, (good, why) in enumerate(votes):
            if not good:
                reasons.setdefault(why or "failed", []).append(r)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {why}" for why, rs in reasons.items()]
        return False, "; ".join(parts)

    def attempt(self, fn: Callable[[], Any], what: str = "") -> tuple[bool, Any, str | None]:
        """Run a *local* (collective-free) step on every rank, then agree. Returns (ok, value, reason)."""
        try:
            value = fn()
            ok, why = True, None
        except Exception as e:  # noqa: BLE001
            value, ok, why = None, False, (f"{what}: " if what else "") + short_exc(e)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        all_ok, reason = self.agree(ok, why)
        return all_ok, (value if all_ok else None), reason

    def log(self, msg: str, all_ranks: bool = False) -> None:
        if all_ranks or self.is_main:
            prefix = f"[rank {self.rank}] " if all_ranks else ""
            print(prefix + msg, flush=True)


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def require_multi_gpu(script: str, min_world: int = 2) -> None:
    """Exit with a clear message (and no numbers) when not launched on >= min_world GPUs."""
    ws = world_size_from_env()
    if ws < min_world:
        msg = (
            f"{script}: needs at least {min_world} ranks/GPUs (got WORLD_SIZE={ws}). Launch with "
            f"`torchrun --nproc-per-node N {script}` for N in 2, 4, 8. No numbers were produced."
        )
        print(msg, file=sys.stderr, flush=True)
        raise NotEnoughGPUs(2)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print(f"{script}: CUDA is not available. No numbers were produced.", file=sys.stderr, flush=True)
        raise NotEnoughGPUs(2)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    if torch.cuda.device_count() < local_world:
        print(
            f"{script}: {local_world} local ranks but only {torch.cuda.device_count()} visible GPU(s); one GPU per "
            "rank is required. No numbers were produced.",
            file=sys.stderr,
            flush=True,
        )
        raise NotEnoughGPUs(2)


def init_distributed(gloo_timeout_s: float = 1800.0) -> Dist:
    import datetime

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:  # very old torch: no device_id
            dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
    d = Dist(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        gloo=gloo,
        nccl=dist.group.WORLD,
    )
    # Warm the NCCL communicator eagerly (graph capture needs it initialised).
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return d


def check_same_args(d: Dist, args_dict: dict) -> None:
    """All ranks must run the same pinned configuration (sizes, iteration counts...)."""
    digest = hashlib.sha1(json.dumps(args_dict, sort_keys=True, default=str).encode()).hexdigest()
    digests = d.all_gather_obj(digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks were launched with different arguments: {digests}")


def shutdown(d: Dist | None, exit_after_s: float | None = None) -> None:
    """Barrier and tear down. Results are written before this: if a peer's IPC/NCCL teardown hangs (seen once
    on 2x H200 after a complete run), a command-line run exits anyway after exit_after_s (never armed when
    main() is called in-process, e.g. by tests)."""
    import torch.distributed as dist

    def force_exit() -> None:
        time.sleep(exit_after_s)
        print(f"teardown did not finish within {exit_after_s:.0f} s; exiting (results were already written)",
              flush=True)
        os._exit(0)

    if exit_after_s is not None:
        threading.Thread(target=force_exit, daemon=True, name="bench-teardown").start()
    try:
        if d is not None:
            d.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class Watchdog:
    """Ends a run that exceeds its time limit (a peer kernel that spins forever), after ``on_timeout`` (which
    rank 0 uses to write the partial results). 0 disables it."""

    def __init__(self, seconds: float, on_timeout: Callable[[], None] | None = None) -> None:
        self.seconds = float(seconds or 0)
        self.on_timeout = on_timeout
        self._done = threading.Event()
        self.t0 = time.monotonic()
        if self.seconds > 0:
            threading.Thread(target=self._run, daemon=True, name="bench-watchdog").start()

    def _run(self) -> None:
        if self._done.wait(self.seconds):
            return
        print(f"[watchdog] time limit of {self.seconds:.0f} s exceeded; writing partial results and exiting",
              file=sys.stderr, flush=True)
        try:
            if self.on_timeout:
                self.on_timeout()
        finally:
            os._exit(124)

    def stop(self) -> None:
        self._done.set()


# ---------------------------------------------------------------------------------------------------------
# NCCL's P2P mode: which NCCL a run measures
#
# NCCL reads NCCL_P2P_DISABLE (like its other parameters) once per process, when its first communicator is
# created, and init_distributed creates one right away. A run therefore measures exactly one NCCL, and each
# has its own name in the results: `nccl` (P2P allowed: the default mode) or `nccl_no_p2p` (--no-p2p: the
# benchmark sets NCCL_P2P_DISABLE=1 before init_distributed, so NCCL moves data through its shared-memory
# transport, staged in host memory). A name that does not fit the mode is refused before NCCL starts.

NO_P2P_TAG = "nop2p"
NCCL_PLAIN = "nccl"
NCCL_NO_P2P = "nccl_no_p2p"
_ENV_NOT_RECORDED = ("HOST", "ADDR", "SOCKET", "IB_")
_VIA_RE = re.compile(r"\bvia ([A-Za-z][A-Za-z0-9]*)/")
_NCCL_VERSION_RE = re.compile(r"\bNCCL version (\S+)")


def nccl_label_error(names: Iterable[str], no_p2p: bool) -> str | None:
    """Why these implementation/backend names cannot be measured in this mode, or None."""
    names = list(names)
    if no_p2p and NCCL_PLAIN in names:
        return (f"--no-p2p runs NCCL with NCCL_P2P_DISABLE=1, which is not the NCCL that `{NCCL_PLAIN}` names: "
                f"ask for `{NCCL_NO_P2P}` instead (or drop --no-p2p to measure NCCL with P2P)")
    if not no_p2p and NCCL_NO_P2P in names:
        return (f"`{NCCL_NO_P2P}` needs --no-p2p: NCCL reads NCCL_P2P_DISABLE once per process, when its first "
                "communicator is created, and only that mode sets it before NCCL starts")
    return None


def _nccl_int_on(value: str | None) -> bool:
    """NCCL reads its switches as integers; any nonzero value is on, anything unparsable reads as 0."""
    if value is None:
        return False
    try:
        return int(value.strip(), 0) != 0
    except ValueError:
        return False


def p2p_disabling_env(environ: Mapping[str, str]) -> list[str]:
    """The settings in ``environ`` that turn NCCL's P2P transport off, as 'NAME=value'."""
    out = []
    if _nccl_int_on(environ.get("NCCL_P2P_DISABLE")):
        out.append(f"NCCL_P2P_DISABLE={environ['NCCL_P2P_DISABLE']}")
    level = environ.get("NCCL_P2P_LEVEL", "").strip().upper()
    if level in ("LOC", "0"):
        out.append(f"NCCL_P2P_LEVEL={environ['NCCL_P2P_LEVEL']}")
    return out


def nccl_env(environ: Mapping[str, str] | None = None) -> dict:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("NCCL_") and not any(s in k for s in _ENV_NOT_RECORDED)}


def _nccl_started() -> bool:
    tdist = sys.modules.get("torch.distributed")
    try:
        return bool(tdist is not None and tdist.is_available() and tdist.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def prepare_nccl_mode(no_p2p: bool, uses_nccl_label: bool, environ: dict | None = None, *,
                      nccl_started: bool | None = None) -> dict:
    """Set up (``no_p2p``) or check (default mode) NCCL's P2P settings; call BEFORE init_distributed.

    uses_nccl_label: the run records a result under an NCCL name (`nccl`, `nccl_no_p2p`, SGLang's NCCL).
    Raises ValueError when the environment would make a label wrong. Returns the record for the JSON
    (``mode``, ``env_at_init``: the NCCL_* variables NCCL starts with, ``set_by_benchmark``, ``env_before``);
    ``_debug_file`` (not for the JSON) is where NCCL's INFO log goes when the benchmark asked for it.
    """
    env = os.environ if environ is None else environ
    started = _nccl_started() if nccl_started is None else nccl_started
    if not no_p2p:
        bad = p2p_disabling_env(env)
        if bad and uses_nccl_label:
            raise ValueError(f"{', '.join(bad)} is set, so NCCL would run without P2P while its results are "
                             f"recorded as `{NCCL_PLAIN}`: unset it, or run with --no-p2p (`{NCCL_NO_P2P}`)")
        return {"mode": "default", "no_p2p": False, "env_at_init": nccl_env(env), "set_by_benchmark": {},
                "p2p_disabled_by": bad}
    if started:
        raise ValueError("--no-p2p must set NCCL_P2P_DISABLE=1 before NCCL starts, but torch.distributed is "
                         "already initialised in this process (NCCL may have read its settings already)")
    if _nccl_int_on(env.get("NCCL_SHM_DISABLE")):
        raise ValueError(f"--no-p2p measures NCCL's shared-memory transport, but NCCL_SHM_DISABLE="
                         f"{env['NCCL_SHM_DISABLE']} is set (NCCL would use its network transport): unset it")
    if _nccl_int_on(env.get("NCCL_NVLS_ENABLE")):
        raise ValueError(f"--no-p2p measures NCCL through host memory, but NCCL_NVLS_ENABLE="
                         f"{env['NCCL_NVLS_ENABLE']} lets NCCL use NVLink SHARP: unset it or set it to 0")
    wanted = {"NCCL_P2P_DISABLE": "1"}
    if env.get("NCCL_NVLS_ENABLE") is None:
        wanted["NCCL_NVLS_ENABLE"] = "0"
    debug_file = None
    log_note = "not collected: NCCL_DEBUG or NCCL_DEBUG_FILE was set by the caller"
    if env.get("NCCL_DEBUG") is None and env.get("NCCL_DEBUG_FILE") is None:
        import tempfile

        debug_file = os.path.join(tempfile.mkdtemp(prefix="bench-nccl-log-"), "nccl.%p.log")
        wanted.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": debug_file})
        log_note = ("NCCL_DEBUG=INFO into a per-process file, parsed for its 'via <transport>' channel lines "
                    "(the file itself is not kept: its lines name the host)")
    before = {k: env.get(k) for k in wanted}
    env.update(wanted)
    return {
        "mode": "no_p2p",
        "no_p2p": True,
        "how": "--no-p2p: NCCL_P2P_DISABLE=1 set by the benchmark before the first NCCL communicator",
        "set_by_benchmark": dict(wanted),
        "env_before": before,
        "env_at_init": nccl_env(env),
        "transport_log": log_note,
        "_debug_file": debug_file,
    }


def enter_nccl_mode(script: str, no_p2p: bool, uses_nccl_label: bool) -> dict:
    """prepare_nccl_mode for a script's main(): a refusal exits 2 with one line, before any number."""
    try:
        return prepare_nccl_mode(no_p2p, uses_nccl_label)
    except ValueError as e:
        print(f"{script}: {e}. No numbers were produced.", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def parse_nccl_log(text: str) -> dict:
    """NCCL INFO log -> {"transports": {"SHM": n, "P2P": m, ...} (channel connections), "nccl_version"}."""
    counts: dict[str, int] = {}
    for m in _VIA_RE.finditer(text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    v = _NCCL_VERSION_RE.search(text)
    return {"transports": counts, "nccl_version": v.group(1) if v else None}


def read_nccl_log(debug_file: str | None) -> dict | None:
    """This process's NCCL log (NCCL_DEBUG_FILE with %p = this pid), parsed; None when none was asked for."""
    if not debug_file:
        return None
    path = Path(debug_file.replace("%p", str(os.getpid())))
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"found": False, "transports": {}, "nccl_version": None}
    return {"found": True, **parse_nccl_log(text)}


def merge_nccl_logs(per_rank: Sequence[dict | None]) -> dict:
    """Every rank's parsed log -> the transports NCCL logged over all ranks and a verdict on P2P."""
    logs = [x for x in per_rank if x]
    total: dict[str, int] = {}
    for x in logs:
        for k, n in x.get("transports", {}).items():
            total[k] = total.get(k, 0) + n
    versions = sorted({x["nccl_version"] for x in logs if x.get("nccl_version")})
    if not logs:
        verdict = "not collected"
    elif not any(x.get("found") for x in logs):
        verdict = "no NCCL log file was written"
    elif "P2P" in total:
        verdict = "P2P channels logged: NCCL did not run without P2P"
    elif total:
        verdict = "no P2P channel logged"
    else:
        verdict = "no channel lines logged"
    return {"ranks_with_log": sum(1 for x in logs if x.get("found")), "transports_seen": total,
            "nccl_version_logged": versions[0] if len(versions) == 1 else (versions or None),
            "p2p_seen": ("P2P" in total) if total else None, "verdict": verdict}


def collect_nccl_transports(d: Dist, mode: dict) -> None:
    """Collective (every rank calls it at the same point): gather what NCCL logged into ``mode``."""
    local = None
    with contextlib.suppress(Exception):
        local = read_nccl_log(mode.get("_debug_file"))
    merged = merge_nccl_logs(d.all_gather_obj(local))
    if mode.get("_debug_file"):
        mode["transports"] = merged
        if merged["p2p_seen"]:
            d.log(f"WARNING: --no-p2p run, but NCCL logged P2P channels: {merged['transports_seen']}")


def cleanup_nccl_log(mode: dict | None) -> None:
    f = (mode or {}).get("_debug_file")
    if not f:
        return
    with contextlib.suppress(Exception):
        Path(f.replace("%p", str(os.getpid()))).unlink(missing_ok=True)
        Path(f).parent.rmdir()  # each process made its own folder (prepare_nccl_mode)


def nccl_setup_line(setup: Mapping) -> str:
    """One line for the tables: the NCCL a --no-p2p run measured."""
    env = setup.get("env_at_init") or {}
    tr = setup.get("transports") or {}
    return (f"NCCL {setup.get('nccl_version')} with NCCL_P2P_DISABLE={env.get('NCCL_P2P_DISABLE')} at init; "
            f"channels NCCL logged: {tr.get('transports_seen', {})} ({tr.get('verdict', 'not collected')})")


def public_nccl_mode(mode: dict | None) -> dict | None:
    """The record without its private keys (the local log path)."""
    return None if mode is None else {k: v for k, v in mode.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------------------
# CUDA-graph timing


def capture_graph(
    step: Callable[[int], Any], calls: int, *, eager_warmup: int = 1, stream: Any = None
) -> tuple[Any, list]:
    """Run ``step(k)`` for k in range(calls) eagerly ``eager_warmup`` times, then capture the same calls into
    one graph (on ``stream`` if given, e.g. SGLang's graph_capture stream). Returns (graph, outputs)."""
    import torch

    for _ in range(eager_warmup):
        for k in range(calls):
            step(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outs: list = []
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        for k in range(calls):
            outs.append(step(k))
    torch.cuda.synchronize()
    return g, outs


def time_graph(d: Dist, graph: Any, *, calls: int, iters: int, warmup: int) -> dict:
    """Replay ``graph`` warmup + iters times back to back (no host sync in between, so host skew between
    ranks is absorbed by the warmup replays); time each timed replay with CUDA events; per-call us =
    replay / calls; gather over gloo; MAX over ranks per iteration; MEDIAN over iterations.
    Raises the same error on every rank if any rank failed."""
    import torch

    d.barrier()
    local, err = None, None
    try:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize()
        for _ in range(warmup):
            graph.replay()
        for i in range(iters):
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize()
        local = [starts[i].elapsed_time(ends[i]) * 1000.0 / calls for i in range(iters)]
    except Exception as e:  # noqa: BLE001
        err = short_exc(e)
    gathered = d.all_gather_obj((local, err))
    errs = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if errs:
        raise RuntimeError("timing failed: " + "; ".join(errs))
    out = aggregate_iteration_times([g[0] for g in gathered])
    out["calls_per_replay"] = calls
    return out


def cuda_healthy(d: Dist) -> tuple[bool, str | None]:
    """After a failure: is every rank's CUDA context still usable (no sticky error)?"""
    import torch

    def probe():
        t = torch.ones(4, device=d.device)
        t.add_(1)
        torch.cuda.synchronize()
        if float(t.sum()) != 8.0:
            raise RuntimeError("probe kernel gave a wrong answer")

    ok, _, why = d.attempt(probe, "CUDA health probe")
    return ok, why


def tensor_digest(t: Any) -> str:
    import torch

    v = t.detach().contiguous()
    if v.dtype in (torch.bfloat16, torch.float16):
        v = v.view(torch.int16)
    return hashlib.sha1(v.cpu().numpy().tobytes()).hexdigest()


def bitwise_equal_across_ranks(d: Dist, t: Any) -> bool:
    return len(set(d.all_gather_obj(tensor_digest(t)))) == 1


# ---------------------------------------------------------------------------------------------------------
# Residual add + RMSNorm kernels (the unfused epilogue after a plain all-reduce)


def reference_add_rmsnorm(x, residual, weight, eps):
    """fp32 reference of the fused op's contract: residual_out rounded once, norm from the rounded value."""
    import torch

    res = (x.float() + residual.float()).to(x.dtype) if residual is not None else x
    v = res.float()
    norm = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return norm, res


@dataclass
class NormKernel:
    """add_rmsnorm_(x, residual, w, eps): in place, residual <- x + residual, x <- rmsnorm(residual) * w.
    rmsnorm(x, w, eps) -> new tensor."""

    name: str
    add_rmsnorm_: Callable
    rmsnorm: Callable


def torch_norm_kernel() -> NormKernel:
    """Unfused torch ops with the reference numerics (CPU emulation in tests; last-resort fallback)."""

    def add_(x, r, w, eps):
        n, s = reference_add_rmsnorm(x, r, w, eps)
        r.copy_(s)
        x.copy_(n)

    def rms(x, w, eps):
        return reference_add_rmsnorm(x, None, w, eps)[0]

    return NormKernel("torch (unfused reference ops)", add_, rms)


def _norm_candidates() -> list[tuple[str, Callable[[], NormKernel]]]:
    def sgl():
        mod = importlib.import_module("sgl_kernel")
        return NormKernel("sgl_kernel.fused_add_rmsnorm", mod.fused_add_rmsnorm, mod.rmsnorm)

    def flashinfer():
        mod = importlib.import_module("flashinfer.norm")
        return NormKernel("flashinfer.norm.fused_add_rmsnorm", mod.fused_add_rmsnorm, mod.rmsnorm)

    def triton_():
        setup_import_paths()
        mod = importlib.import_module("benchmarks.harness.triton_add_rmsnorm")
        return NormKernel("triton (benchmarks/harness/triton_add_rmsnorm.py)", mod.fused_add_rmsnorm, mod.rmsnorm)

    return [("sgl_kernel", sgl), ("flashinfer", flashinfer), ("triton", triton_), ("torch", torch_norm_kernel)]


def _validate_norm(k: NormKernel, device, hidden: int, eps: float) -> None:
    import torch

    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randint(-4, 5, (3, hidden), generator=g).to(torch.bfloat16).to(device)
    r = torch.randint(-4, 5, (3, hidden), generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    ref_n, ref_r = reference_add_rmsnorm(x, r, w, eps)
    ref_plain = reference_add_rmsnorm(x, None, w, eps)[0]
    plain = k.rmsnorm(x.clone(), w, eps)
    k.add_rmsnorm_(x, r, w, eps)
    torch.cuda.synchronize()
    if not torch.equal(r, ref_r):
        raise RuntimeError("residual output differs from reference")
    if not torch.allclose(x.float(), ref_n.float(), rtol=1 / 64, atol=1 / 64):
        raise RuntimeError(f"norm output differs from reference (max {(x.float() - ref_n.float()).abs().max():.3g})")
    if plain is None or not torch.allclose(plain.float(), ref_plain.float(), rtol=1 / 64, atol=1 / 64):
        raise RuntimeError("plain rmsnorm differs from reference")


def select_norm_kernel(d: Dist, hidden: int, eps: float, prefer: str | None = None) -> tuple[NormKernel, list]:
    """First of sgl_kernel / flashinfer / triton / torch that imports AND computes correctly on every rank
    (stand-in modules that raise when called are rejected here). Returns (kernel, [(name, reason) rejected])."""
    cands = _norm_candidates()
    if prefer:
        cands = [c for c in cands if c[0] == prefer] + [c for c in cands if c[0] != prefer]
    rejected = []
    for name, make in cands:

        def attempt(make=make):
            k = make()
            _validate_norm(k, d.device, hidden, eps)
            return k

        ok, k, why = d.attempt(attempt, name)
        if ok:
            return k, rejected
        rejected.append((name, why))
    raise RuntimeError(f"no add+rmsnorm kernel works: {rejected}")


# ---------------------------------------------------------------------------------------------------------
# Hardware and versions (no hostname)


def _nvidia_smi(query: str) -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def driver_version() -> str | None:
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001
        pass
    lines = _nvidia_smi("driver_version")
    return lines[0] if lines else None


def nccl_version() -> str | None:
    try:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        return None


# Prefix of every line the benchmarks print in their result tables. Empty on GPUs; cpu_smoke.py sets it so that
# no line of a CPU control-flow run, copied out of context, reads like a measurement.
TABLE_TAG = ""


def table_print(text: str = "") -> None:
    for line in text.split("\n"):
        print(f"{TABLE_TAG}{line}" if line.strip() else line)


def hardware_info(d: Dist | None = None) -> dict:
    import torch

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    n_vis = torch.cuda.device_count()
    world = d.world_size if d else 1
    p2p = None
    try:
        p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n_vis)] for i in range(n_vis)]
    except Exception:  # noqa: BLE001
        pass
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "SGLANG_SM120", "CUDA_VISIBLE"))}
    env = {k: v for k, v in env.items() if not any(s in k for s in _ENV_NOT_RECORDED)}
    return {
        "gpu": props.name,
        "gpu_slug": gpu_slug(props.name),
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / (1 << 30), 1),
        "gpu_count_visible": n_vis,
        "world_size": world,
        "p2p_access": p2p,
        "driver": driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "nccl": nccl_version(),
        "python": sys.version.split()[0],
        "versions": {
            k: package_version(k)
            for k in ("triton", "sglang", "flashinfer-python", "sgl-kernel", "sglang-sm120", "apache-tvm-ffi")
        },
        "env": env,
    }


def result_path(out_dir: Path, kind: str, gpu: str, world: int, suffix: str = ".json", tag: str = "") -> Path:
    """<out>/<kind>_<gpu>_tp<N>[_<tag>]<suffix>; tag "nop2p" for the --no-p2p runs (see output_tag)."""
    return Path(out_dir) / f"{kind}_{gpu_slug(gpu)}_tp{world}{'_' + tag if tag else ''}{suffix}"


def output_tag(no_p2p: bool) -> str:
    return NO_P2P_TAG if no_p2p else ""


def iter_unique(xs: Iterable) -> list:
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
