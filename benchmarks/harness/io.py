"""Result files and their words: where results go, JSON and plots, table lines, and the small parsers and
formatters every benchmark uses. Pure Python (matplotlib optional); covered by tests/bench/test_schema.py."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1


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


# Prefix of every line the benchmarks print in their result tables. Empty on GPUs; cpu_smoke.py sets it so that
# no line of a CPU control-flow run, copied out of context, reads like a measurement.
TABLE_TAG = ""


def table_print(text: str = "") -> None:
    for line in text.split("\n"):
        print(f"{TABLE_TAG}{line}" if line.strip() else line)


def result_path(out_dir: Path, kind: str, gpu: str, world: int, suffix: str = ".json", tag: str = "") -> Path:
    """<out>/<kind>_<gpu>_tp<N>[_<tag>]<suffix>; tag "nop2p" for the --no-p2p runs (see output_tag)."""
    return Path(out_dir) / f"{kind}_{gpu_slug(gpu)}_tp{world}{'_' + tag if tag else ''}{suffix}"


def iter_unique(xs: Iterable) -> list:
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
