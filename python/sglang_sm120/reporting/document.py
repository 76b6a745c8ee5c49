"""The report a user of a real box sends: one markdown file with its JSON attached, built offline from what is
on the machine, without torch and without a GPU of its own (the doctor, which needs them, runs as a separate
process).

Sections: environment (OS, packages, driver, nvidia-smi's GPU list and topology matrix, the kernel command
line's IOMMU settings), the doctor's output, every routing table in the cache folder (or the ones named), the
result documents named (every kind this repository writes: RESULT_KINDS), and at the end every file named that
was not used, with why. The host name is replaced by "<host>" wherever it stands as a word of its own. The
attached JSON holds the same data, with the result documents cut to the fields that make their tables, so the
whole stays small enough to paste into an issue (GitHub takes about 65,000 characters).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..routing import cache
from ..routing.table import RoutingTable
from . import render, schema

REPORT_VERSION = 1
ISSUE_LIMIT_CHARS = 65000
PACKAGES = ("sglang-sm120", "sglang", "torch", "sgl-kernel", "flashinfer-python", "triton", "nvidia-nccl-cu13",
            "nvidia-nccl-cu12", "nvidia-ml-py")
ALLREDUCE_FIELDS = ("impl", "label", "op", "rows", "hidden", "dtype", "bytes", "world_size", "median_us", "error")
VERIFY_FIELDS = ("backend", "compute", "tokens", "world_size", "step_us", "comm_us")
# The result documents this repository writes (benchmarks/*.py, scripts/diagnose_trap_delivery.py, the tuner's
# --out), by the kind `classify` gives them.
RESULT_KINDS = {
    "allreduce": "benchmarks/bench_allreduce.py",
    "verify": "benchmarks/bench_verify.py",
    "transports": "benchmarks/bench_transports.py",
    "polling": "benchmarks/bench_polling.py",
    "tuner_pick": "benchmarks/bench_tuner_pick.py",
    "trap delivery": "scripts/diagnose_trap_delivery.py",
    "routing table": "python -m sglang_sm120.tune --out",
    "server test": "tests/gpu/test_sglang_server.py",
}
# Fields of a bench_transports / bench_polling / bench_tuner_pick record kept when one is cut (a wrong result is
# always kept).
RECORD_FIELDS = ("mode", "op", "kind", "world", "rows", "hidden", "dtype", "variant", "transport", "route",
                 "polling", "cluster", "us_per_call_median", "us", "result_correct", "error")


def _run(command: Sequence[str], timeout: float = 30.0) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({command[0]} failed: {exc})"
    return (done.stdout or "") + (done.stderr or "")


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(run: Callable[[Sequence[str]], str | None] = _run) -> dict[str, Any]:
    driver = None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as handle:
            driver = handle.readline().strip()
    except OSError:
        pass
    try:
        with open("/proc/cmdline", encoding="utf-8") as handle:
            cmdline = [w for w in handle.read().split() if "iommu" in w or w.startswith(("pci=", "pcie_"))]
    except OSError:
        cmdline = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "driver": driver,
        "kernel_cmdline_pcie": cmdline,
        "nvidia_smi": run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id,driver_version,memory.total",
                           "--format=csv"]),
        "topology": run(["nvidia-smi", "topo", "-m"]),
        "cache_dir": cache.cache_dir(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("SGLANG_SM120_", "SGL_SM120_", "NCCL_")) or k == "CUDA_VISIBLE_DEVICES"},
    }


def run_doctor(args: Sequence[str] = (), timeout_s: float = 600.0) -> dict[str, Any]:
    """`python -m sglang_sm120.doctor` in its own process (it needs torch and the GPUs; the report does not)."""
    command = [sys.executable, "-m", "sglang_sm120.doctor", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        return {"command": " ".join(command[1:]), "exit_code": done.returncode,
                "output": (done.stdout or "") + (done.stderr or "")}
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"command": " ".join(command[1:]), "exit_code": None,
                "output": out + f"\n(the doctor did not finish within {timeout_s:.0f} s)"}
    except OSError as exc:
        return {"command": " ".join(command[1:]), "exit_code": None, "output": f"(could not start: {exc})"}


def classify(doc: Any) -> str | None:
    """Which RESULT_KINDS a parsed JSON document is, or None."""
    if not isinstance(doc, Mapping):
        return None
    named = str(doc.get("benchmark") or "").removeprefix("bench_")
    if named in ("allreduce", "verify", "transports", "polling", "tuner_pick"):
        return named
    if "pattern" in doc:
        return "verify"
    if "crossover_bytes" in doc:
        return "allreduce"
    if "dmesg_xid" in doc and isinstance(doc.get("ranks"), Mapping):
        return "trap delivery"
    if {"format", "tune_version", "entries", "measurements"} <= doc.keys():
        return "routing table"
    if {"sglang", "runs", "checks"} <= doc.keys():
        return "server test"
    return None


def read_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Every result document under `paths` (files or folders), validated; a file that is not one (in a folder:
    every file that is not JSON too) is listed with the reason, as {"path", "error"}."""
    files: list[str] = []
    out: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    for path in paths:
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if name.endswith(".json"):
                    files.append(full)
                elif os.path.isfile(full):
                    others.append({"path": full, "error": "not a JSON result document"})
        else:
            files.append(path)
    for path in files:
        entry: dict[str, Any] = {"path": path}
        try:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
            kind = classify(doc)
            if kind == "allreduce":
                schema.validate_allreduce_doc(doc)
            elif kind == "verify":
                schema.validate_verify_doc(doc)
            elif kind == "routing table":
                RoutingTable.from_dict(doc)
            elif kind is None:
                raise schema.SchemaError(f"not a result document this repository writes ({', '.join(RESULT_KINDS)})")
            entry.update(kind=kind, doc=doc)
        except (OSError, ValueError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return out + others


def _slim(entry: Mapping[str, Any]) -> dict[str, Any]:
    if "doc" not in entry:
        return dict(entry)
    doc, kind = entry["doc"], entry["kind"]
    head = {"path": entry["path"], "kind": kind}
    if kind == "routing table":
        return {**head, "table": doc}
    if kind in ("transports", "polling", "tuner_pick"):
        records = doc.get("records") or []
        return {**head, "hardware": doc.get("hardware"), "date": doc.get("timestamp"), "note": doc.get("note"),
                "summary": doc.get("summary") or doc.get("comparisons"), "records": len(records),
                "incorrect": [{k: r.get(k) for k in RECORD_FIELDS if k in r} for r in records
                              if r.get("result_correct") is False]}
    if kind == "server test":  # the verdicts; the runs' requests and log tails stay in the file
        return {**head, "sglang": doc.get("sglang"),
                "runs": {name: {k: run.get(k) for k in ("mode", "graphs", "start_s") if k in run}
                         | ({"error": str(run["error"])[-300:]} if "error" in run else {})
                         for name, run in (doc.get("runs") or {}).items()},
                "checks": {name: bool((c or {}).get("ok")) for name, c in (doc.get("checks") or {}).items()}}
    if kind == "trap delivery":
        return {**head, "world": doc.get("world"), "kernel_timeout_s": doc.get("kernel_timeout_s"),
                "ranks": {r: (v or {}).get("state") for r, v in (doc.get("ranks") or {}).items()},
                "dmesg_lines": len(doc.get("dmesg_xid") or []), "note": doc.get("note")}
    fields = ALLREDUCE_FIELDS if kind == "allreduce" else VERIFY_FIELDS
    return {**head, "hardware": doc.get("hardware"), "date": doc.get("date"),
            "results": [{k: r.get(k) for k in fields if k in r} for r in doc.get("results", [])],
            "skipped": list({json.dumps(x, sort_keys=True): x for x in doc.get("skipped", [])}.values())}


def build(*, env: Mapping[str, Any], doctor: Mapping[str, Any] | None, tables: Sequence[cache.Loaded],
          results: Sequence[Mapping[str, Any]], created: str | None = None) -> dict[str, Any]:
    created = created or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "report_version": REPORT_VERSION,
        "created": created,
        "environment": dict(env),
        "doctor": dict(doctor) if doctor is not None else None,
        "tables": [{"path": t.path, "status": t.status, "reason": t.reason,
                    "table": t.table.to_dict() if t.table is not None else None} for t in tables],
        "results": [_slim(r) for r in results],
    }


def _fence(text: str, lang: str = "") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def markdown(report: Mapping[str, Any], *, tables: Sequence[cache.Loaded] = (),
             results: Sequence[Mapping[str, Any]] = ()) -> str:
    env = report["environment"]
    packages = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
    parts = [
        "## sglang-sm120 report",
        "",
        f"Created {report['created']} by `python -m sglang_sm120.report` (report format {report['report_version']}).",
        "",
        "### Environment",
        "",
        f"- Python {env['python']}, {env['platform']}",
        f"- packages: {packages or 'none found'}",
        f"- driver: {env.get('driver') or 'unknown'}",
        f"- kernel command line (IOMMU/PCIe): {' '.join(env.get('kernel_cmdline_pcie') or []) or 'nothing set'}",
        f"- settings: {', '.join(f'{k}={v}' for k, v in env.get('env', {}).items()) or 'none'}",
        "",
        _fence(env.get("nvidia_smi") or "(nvidia-smi not found)"),
        "",
        _fence(env.get("topology") or "(no topology)"),
        "",
        "### Doctor",
        "",
    ]
    doctor = report.get("doctor")
    if doctor is None:
        parts.append("(not run: --no-doctor)")
    else:
        parts += [f"`python {doctor['command']}` exited with {doctor['exit_code']}:", "", _fence(doctor["output"])]
    parts += ["", "### Routing tables", ""]
    if not tables:
        parts.append(f"none in {env.get('cache_dir')}: run `python -m sglang_sm120.tune`")
    for loaded in tables:
        if loaded.table is None:
            parts.append(f"- `{loaded.path}`: {loaded.status} ({loaded.reason})")
        else:
            parts += [render.table_markdown(loaded.table, path=loaded.path, title=os.path.basename(loaded.path)), ""]
    parts += ["", "### Benchmark results", ""]
    if not results:
        parts.append("none given (`--results benchmarks/results/<file>.json`)")
    used = [entry for entry in results if "doc" in entry]
    if results and not used:
        parts.append("none of the files named is a result document (see the end)")
    for entry in used:
        parts += [_result_markdown(entry), ""]
    attached = json.dumps(report, sort_keys=True, separators=(",", ":"))
    parts += ["", "<details><summary>JSON</summary>", "", _fence(attached, "json"), "", "</details>", ""]
    skipped = [entry for entry in results if "doc" not in entry]
    if skipped:
        parts += ["### Skipped", ""] + [f"- `{e['path']}`: {e.get('error')}" for e in skipped] + [""]
    return "\n".join(parts)


def _result_markdown(entry: Mapping[str, Any]) -> str:
    doc, kind, name = entry["doc"], entry["kind"], os.path.basename(entry["path"])
    if kind == "routing table":
        return render.table_markdown(RoutingTable.from_dict(doc), path=entry["path"], title=f"{name} (routing table)")
    if kind == "allreduce":
        return f"#### {name}: {render.hardware_line(doc)}\n\n{render.allreduce_doc_markdown(doc)}"
    if kind == "verify":
        return f"#### {name}: {render.hardware_line(doc)}\n\n{render.verify_doc_markdown(doc)}"
    if kind == "trap delivery":
        return f"#### {name}: trap delivery, {doc.get('world')} ranks\n\n{render.trap_delivery_markdown(doc)}"
    if kind == "server test":
        runs = ", ".join(f"{run_name}: " + ("did not start" if "error" in run else f"ready in {run.get('start_s')} s")
                         for run_name, run in (doc.get("runs") or {}).items())
        lines = [f"- {'passed' if (c or {}).get('ok') else 'FAILED'}: {check}"
                 for check, c in (doc.get("checks") or {}).items()]
        return f"#### {name}: real SGLang {doc.get('sglang')} server ({runs})\n\n" + "\n".join(lines)
    title = f"#### {name}: bench_{kind}, {doc.get('hardware')}, {doc.get('timestamp')}"
    return f"{title}\n\n{render.records_doc_markdown(doc)}"


def redact_host(text: str, host: str | None = None) -> str:
    """`text` with the host name replaced by "<host>" where it stands as a word of its own: not inside a longer
    name (host `vm` leaves `nested_pvm=1` alone), so letters, digits, '_' and '-' on either side keep it."""
    host = host or socket.gethostname()
    if not host or len(host) < 2:
        return text
    return re.sub(rf"(?<![A-Za-z0-9_-]){re.escape(host)}(?![A-Za-z0-9_-])", "<host>", text)
