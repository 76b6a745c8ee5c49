"""Where routing tables are kept, and how a table is written and read back.

Folder: `$SGLANG_SM120_CACHE`, default `~/.cache/sglang_sm120` (the folder sgl_kernel_sm120's cluster check caches
its verdicts in: one setting for both). File: `routes_tp<world>_h<hidden>_<gpus>.json`, world size and hidden size
in the name, <gpus> eight hex digits of the GPUs' UUIDs, so two servers on two sets of GPUs of one box, or two
models, keep their own tables. Written atomically (a temporary file in the folder, then rename), so a reader
sees the old table or the new one, never half of one.

Reading (`load`) says what it found, as a `Loaded` with a status:
  ok                the table, for this key, covering this server's sizes
  missing           no file
  corrupt           not JSON, or not the shape a table has
  other versions    another table format or tune procedure, or the key's driver / CUDA / torch / NCCL / our
                    version / kernel library differ
  another key       measured on other GPUs, TP size, islands, P2P matrix or workspace memory
  does not cover    another hidden size, or fewer sizes / dtypes than this server reduces
Every status but ok and missing is logged once as a WARNING naming it, and the table is not used.

A quick tune that failed at a server's start leaves a note beside the table's place (`<table>.failed.json`: the
key, when, why), so the next start with --sm120-allreduce-tune auto does not run it again; a table saved for
that key (the tool, or `force`) removes the note.

A candidate blamed for a crash or a hang of a tune's process (tuning/launch.py names the one that was running)
is written to `blamed_tp<world>_<gpus>.json` with the table key it happened under (`record_blames`); `blames`
returns the ones recorded under a key, which every later tune excludes and no server routes to, whatever its
hidden size. Another key (a new driver, kernel library, ...) lifts them: it is another box as far as a
measurement goes.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from sgl_kernel_sm120.cluster_check import CACHE_ENV, cache_dir

from . import table as tbl

logger = logging.getLogger("sglang_sm120")

__all__ = ["CACHE_ENV", "Loaded", "blame_path", "blames", "cache_dir", "find_tables", "load", "load_file",
           "record_blames", "record_failure", "recorded_failure", "save", "table_path"]

OK, MISSING, CORRUPT, OTHER_VERSIONS, ANOTHER_KEY, NOT_COVERED = (
    "ok", "missing", "corrupt", "other versions", "another key", "does not cover")


@dataclasses.dataclass(frozen=True)
class Loaded:
    status: str
    path: str
    table: tbl.RoutingTable | None = None
    reason: str = ""  # what made it stale or corrupt

    @property
    def ok(self) -> bool:
        return self.status == OK

    def warning(self) -> str:
        """The WARNING for a table that exists but is not used ('' for ok and missing)."""
        if self.status in (OK, MISSING):
            return ""
        return f"sglang_sm120: routing table {self.path} ignored: {self.status} ({self.reason})"


def table_path(key: Mapping[str, Any], hidden: int, folder: str | None = None) -> str:
    folder = cache_dir() if folder is None else folder
    return os.path.join(folder, f"routes_tp{int(key['world_size'])}_h{int(hidden)}_{tbl.box_tag(key)}.json")


def _write_atomically(path: str, doc: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save(table: tbl.RoutingTable, folder: str | None = None, path: str | None = None) -> str:
    """Write `table` atomically; returns the path. Creates the folder. Saved where servers look (no `path`), it
    clears a failed quick tune's note for its key."""
    default = table_path(table.key, int(table.workload["hidden"]), folder)
    _write_atomically(path or default, table.to_dict())
    if not path or path == default:
        try:
            os.unlink(default + FAILED_SUFFIX)
        except FileNotFoundError:
            pass
    return path or default


FAILED_SUFFIX = ".failed.json"


def record_failure(key: Mapping[str, Any], hidden: int, why: str, when: str, folder: str | None = None) -> str:
    """Note that the quick tune of this key failed (see the module docstring); returns the note's path."""
    path = table_path(key, hidden, folder) + FAILED_SUFFIX
    _write_atomically(path, {"key": dict(key), "when": when, "why": why})
    return path


def recorded_failure(key: Mapping[str, Any], hidden: int, folder: str | None = None) -> dict[str, Any] | None:
    """The note of a failed quick tune of exactly this key ({"when", "why", "path"}), else None."""
    path = table_path(key, hidden, folder) + FAILED_SUFFIX
    try:
        with open(path, encoding="utf-8") as handle:
            note = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or not isinstance(note.get("key"), dict) or tbl.compare_keys(key, note["key"]):
        return None
    return {"when": str(note.get("when")), "why": str(note.get("why")), "path": path}


BLAME_FIELDS = ("dtype", "kind", "candidate", "from_bytes", "reason")


def blame_path(key: Mapping[str, Any], folder: str | None = None) -> str:
    folder = cache_dir() if folder is None else folder
    return os.path.join(folder, f"blamed_tp{int(key['world_size'])}_{tbl.box_tag(key)}.json")


def _read_blames(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return []
    found = doc.get("blamed") if isinstance(doc, dict) else None
    if not isinstance(found, list):
        return []
    return [b for b in found if isinstance(b, dict) and isinstance(b.get("key"), dict)]


def record_blames(key: Mapping[str, Any], culprits, when: str, folder: str | None = None) -> str:
    """Add candidates blamed for a crash or hang under `key` ({dtype, kind, candidate, from_bytes, reason} each;
    module docstring); one that is there already keeps the smaller from_bytes. Returns the file's path."""
    path = blame_path(key, folder)
    kept = _read_blames(path)
    for culprit in culprits:
        entry = {field: culprit[field] for field in BLAME_FIELDS}
        entry["from_bytes"] = int(entry["from_bytes"])
        same = [b for b in kept if not tbl.compare_keys(key, b["key"])
                and all(b.get(f) == entry[f] for f in ("dtype", "kind", "candidate"))]
        if same:
            same[0]["from_bytes"] = min(int(same[0].get("from_bytes", 0)), entry["from_bytes"])
            continue
        kept.append({**entry, "key": dict(key), "when": when})
    _write_atomically(path, {"blamed": kept})
    return path


def blames(key: Mapping[str, Any], folder: str | None = None) -> list[dict[str, Any]]:
    """The candidates blamed under exactly this key ({dtype, kind, candidate, from_bytes, reason, when})."""
    return [{field: b.get(field) for field in BLAME_FIELDS + ("when",)}
            for b in _read_blames(blame_path(key, folder)) if not tbl.compare_keys(key, b["key"])]


def load_file(path: str) -> Loaded:
    """Read one table file and check its format and tune versions (not its key)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return Loaded(MISSING, path)
    except OSError as exc:
        return Loaded(CORRUPT, path, reason=f"cannot read it: {exc}")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return Loaded(CORRUPT, path, reason=f"bad JSON: {exc}")
    if isinstance(doc, dict):
        fmt, version = doc.get("format"), doc.get("tune_version")
        if fmt != tbl.FORMAT_VERSION:
            return Loaded(OTHER_VERSIONS, path, reason=f"table format {fmt!r}, this build reads {tbl.FORMAT_VERSION}")
        if version != tbl.TUNE_VERSION:
            return Loaded(OTHER_VERSIONS, path,
                          reason=f"tune procedure {version!r}, this build measures with {tbl.TUNE_VERSION}")
    try:
        return Loaded(OK, path, tbl.RoutingTable.from_dict(doc))
    except tbl.TableError as exc:
        return Loaded(CORRUPT, path, reason=str(exc))


def load(key: Mapping[str, Any], *, hidden: int, dtype: str, max_bytes: int, kinds=tbl.KINDS,
         folder: str | None = None) -> Loaded:
    """The table for this key that covers (dtype, hidden, max_bytes), with its status (module docstring)."""
    found = load_file(table_path(key, hidden, folder))
    if not found.ok:
        return found
    mismatch = tbl.compare_keys(key, found.table.key)
    if mismatch is not None:
        return Loaded(mismatch[0], found.path, reason=f"{mismatch[1]} (the table's -> this group's)")
    gap = found.table.coverage_gap(dtype, hidden, max_bytes, kinds)
    if gap is not None:
        return Loaded(NOT_COVERED, found.path, reason=gap)
    return found


def find_tables(folder: str | None = None) -> list[Loaded]:
    """Every table file in the folder, read (for the report and the doctor)."""
    folder = cache_dir() if folder is None else folder
    return [load_file(path) for path in sorted(glob.glob(os.path.join(folder, "routes_tp*.json")))
            if not path.endswith(FAILED_SUFFIX)]
