"""Where routing tables are kept: `$SGLANG_SM120_CACHE`, default `~/.cache/sglang_sm120` (shared with the kernels'
cluster check), beside the blamed candidates and the failed-tune notes of each set of GPUs (docs/tuning.md names the
files). `load` says what it found; only OK is used, and the reason of any other status names what changed. One tune
of a set of GPUs at a time: `tune_lock`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from sgl_kernel_sm120.settings import read as kernel_settings

from . import table as tbl
from .table import OTHER_VERSIONS

# load's statuses, besides compare_keys' OTHER_VERSIONS (also another table format or tune procedure) and ANOTHER_KEY
OK, MISSING = "ok", "missing"
CORRUPT = "corrupt"  # not JSON, or not a table's shape
NOT_COVERED = "does not cover"  # another hidden size, or a dtype or kind not measured
BLAME_FIELDS = ("dtype", "kind", "candidate", "from_bytes", "reason")


def cache_dir() -> str:
    return kernel_settings().cache_dir


@dataclasses.dataclass(frozen=True)
class Loaded:
    status: str
    path: str
    table: tbl.RoutingTable | None = None
    reason: str = ""  # what made it stale or corrupt

    @property
    def ok(self) -> bool:
        return self.status == OK

    def describe(self) -> str:
        if self.status == MISSING:
            return f"no routing table of this box ({self.path})"
        return f"routing table {self.path} ignored: {self.status} ({self.reason})"


def _in(folder: str | None, name: str) -> str:
    return os.path.join(cache_dir() if folder is None else folder, name)


def table_path(key: Mapping[str, Any], hidden: int, folder: str | None = None) -> str:
    return _in(folder, f"routes_tp{int(key['world_size'])}_h{int(hidden)}_{tbl.box_tag(key)}.json")


def blame_path(key: Mapping[str, Any], folder: str | None = None) -> str:
    return _in(folder, f"blamed_tp{int(key['world_size'])}_{tbl.box_tag(key)}.json")


def failure_path(key: Mapping[str, Any], hidden: int, folder: str | None = None) -> str:
    return _in(folder, f"failed_tp{int(key['world_size'])}_h{int(hidden)}_{tbl.box_tag(key)}.json")


def writable(folder: str | None = None) -> str | None:
    """None when the cache folder can be created and written, else why not."""
    try:
        folder = cache_dir() if folder is None else folder
    except ValueError as exc:  # the setting names a folder that cannot be one (settings.SettingError)
        return str(exc)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-check.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
        return None
    except OSError as exc:
        return f"the cache folder {folder} is not writable ({exc.strerror or exc}); set SGLANG_SM120_CACHE"


@contextlib.contextmanager
def tune_lock(key: Mapping[str, Any], wait_s: float, folder: str | None = None):
    """Held while one process tunes this set of GPUs; yields True once held, False when another held it for all of
    `wait_s` seconds (a second launch then goes on without measuring)."""
    path = _in(folder, f"tune_tp{int(key['world_size'])}_{tbl.box_tag(key)}.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_failure(key: Mapping[str, Any], hidden: int, reason: str, command: str, *, planned: str,
                   folder: str | None = None) -> str:
    """The note of a failed tune of these GPUs, under the digest of what the tool saw (tuning/processes.planned)."""
    path = failure_path(key, hidden, folder)
    _write_atomically(path, {"planned": planned, "reason": reason, "command": command,
                             "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    return path


def clear_failure(key: Mapping[str, Any], hidden: int, folder: str | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(failure_path(key, hidden, folder))


def failure(key: Mapping[str, Any], hidden: int, *, planned: str | None = None,
            folder: str | None = None) -> dict[str, Any] | None:
    """The note of a failed tune of these GPUs and hidden size (of the same `planned` digest when given: a launch
    tunes again once anything it sees changed), or None."""
    path = failure_path(key, hidden, folder)
    try:
        with open(path, encoding="utf-8") as handle:
            note = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or (planned is not None and note.get("planned") != planned):
        return None
    return {"reason": str(note.get("reason")), "when": str(note.get("when")), "command": str(note.get("command")),
            "path": path}


def describe_failure(note: Mapping[str, Any]) -> str:
    return (f"the last tune of these GPUs failed at {note['when']} ({note['reason']}); a launch does not repeat it "
            f"({note['path']}): retry with {note['command']}")


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
    """Write `table` atomically where servers look for it (or to `path`); returns the path."""
    path = path or table_path(table.key, int(table.workload["hidden"]), folder)
    _write_atomically(path, table.to_dict())
    return path


def _read_blames(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle).get("blamed")
    except (OSError, ValueError, AttributeError):
        return []
    return [b for b in found if isinstance(b, dict) and isinstance(b.get("key"), dict)] if isinstance(found, list) \
        else []


def record_blames(key: Mapping[str, Any], culprits, when: str, folder: str | None = None) -> str:
    """Add candidates blamed under `key` (BLAME_FIELDS each); one blamed already keeps the smaller from_bytes.
    Returns the file's path."""
    path = blame_path(key, folder)
    kept = _read_blames(path)
    for culprit in culprits:
        entry = {**{field: culprit[field] for field in BLAME_FIELDS}, "from_bytes": int(culprit["from_bytes"])}
        same = [b for b in kept if not tbl.compare_keys(key, b["key"])
                and all(b.get(f) == entry[f] for f in ("dtype", "kind", "candidate"))]
        if same:
            same[0]["from_bytes"] = min(int(same[0].get("from_bytes", 0)), entry["from_bytes"])
        else:
            kept.append({**entry, "key": dict(key), "when": when})
    _write_atomically(path, {"blamed": kept})
    return path


def blames(key: Mapping[str, Any], folder: str | None = None) -> list[dict[str, Any]]:
    """The candidates blamed under exactly this key."""
    return [{field: b.get(field) for field in BLAME_FIELDS + ("when",)}
            for b in _read_blames(blame_path(key, folder)) if not tbl.compare_keys(key, b["key"])]


def load_file(path: str) -> Loaded:
    """One table file, its format and tune versions checked (not its key)."""
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.loads(handle.read())
    except FileNotFoundError:
        return Loaded(MISSING, path)
    except OSError as exc:
        return Loaded(CORRUPT, path, reason=f"cannot read it: {exc}")
    except ValueError as exc:
        return Loaded(CORRUPT, path, reason=f"bad JSON: {exc}")
    for field, mine, what in (("format", tbl.FORMAT_VERSION, "table format {}, this build reads {}"),
                              ("tune_version", tbl.TUNE_VERSION, "tune procedure {}, this build measures with {}")):
        if isinstance(doc, dict) and doc.get(field) != mine:
            return Loaded(OTHER_VERSIONS, path, reason=what.format(repr(doc.get(field)), mine))
    try:
        return Loaded(OK, path, tbl.RoutingTable.from_dict(doc))
    except tbl.TableError as exc:
        return Loaded(CORRUPT, path, reason=str(exc))


def load(key: Mapping[str, Any], *, hidden: int, dtype: str, kinds=tbl.KINDS, folder: str | None = None) -> Loaded:
    found = load_file(table_path(key, hidden, folder))
    if not found.ok:
        return found
    mismatch = tbl.compare_keys(key, found.table.key)
    if mismatch is not None:
        return Loaded(mismatch[0], found.path, reason=f"{mismatch[1]} (the table's -> this group's)")
    gap = found.table.coverage_gap(dtype, hidden, kinds)
    return found if gap is None else Loaded(NOT_COVERED, found.path, reason=gap)


def find_tables(folder: str | None = None) -> list[Loaded]:
    return [load_file(path) for path in sorted(glob.glob(os.path.join(folder or cache_dir(), "routes_tp*.json")))]
