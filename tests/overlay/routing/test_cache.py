"""The routing-table cache: its folder, atomic writes, and every way a stored table is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sgl_kernel_sm120.settings import read
from sglang_sm120.routing import cache
from sglang_sm120.routing.table import TUNE_VERSION

from .test_table import _table, key


def test_the_folder_is_the_kernel_packages_cache_folder_under_either_spelling(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    assert cache.cache_dir() == read().cache_dir == str(tmp_path)
    assert cache.table_path(key(), 7168).startswith(str(tmp_path) + os.sep)


def test_the_file_name_carries_world_size_hidden_and_gpus(tmp_path):
    name = os.path.basename(cache.table_path(key(), 7168, str(tmp_path)))
    assert name.startswith("routes_tp2_h7168_") and name.endswith(".json")
    other = key()
    other["gpus"] = [{**g, "uuid": g["uuid"] + "x"} for g in other["gpus"]]
    assert cache.table_path(other, 7168, str(tmp_path)) != cache.table_path(key(), 7168, str(tmp_path))


def test_a_saved_table_loads_back_ok(tmp_path):
    table = _table([10, 10], [5, 5])
    path = cache.save(table, str(tmp_path))
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", kinds=("plain",),
                        folder=str(tmp_path))
    assert loaded.ok and loaded.path == path and loaded.table.digest() == table.digest()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_no_file_is_missing(tmp_path):
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "missing" and loaded.describe().startswith("no routing table of this box")


def _write(tmp_path, text):
    path = cache.table_path(key(), 7168, str(tmp_path))
    with open(path, "w") as handle:
        handle.write(text)
    return path


@pytest.mark.parametrize("text, why", [
    ("{not json", "bad JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"format": 1, "tune_version": TUNE_VERSION, "key": {}}), "'measured' is missing"),
])
def test_a_corrupt_file_is_ignored_saying_it_is_corrupt(tmp_path, text, why):
    _write(tmp_path, text)
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "corrupt" and why in loaded.reason
    assert loaded.describe().endswith(f"ignored: corrupt ({loaded.reason})")


def test_a_file_that_is_not_text_is_corrupt(tmp_path):
    with open(cache.table_path(key(), 7168, str(tmp_path)), "wb") as handle:
        handle.write(b"\xff\xfe{")
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "corrupt" and "bad JSON" in loaded.reason


def test_a_corrupt_entry_is_corrupt(tmp_path):
    doc = _table([10, 10], [5, 5]).to_dict()
    doc["entries"][0]["route"] = "sm120/FOURSHOT/push/device"
    _write(tmp_path, json.dumps(doc))
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "corrupt" and "FOURSHOT" in loaded.reason


@pytest.mark.parametrize("field, value, why", [
    ("format", 99, "table format 99, this build reads 1"),
    ("tune_version", 0, f"tune procedure 0, this build measures with {TUNE_VERSION}"),
])
def test_another_format_or_tune_procedure_is_other_versions(tmp_path, field, value, why):
    doc = _table([10, 10], [5, 5]).to_dict()
    doc[field] = value
    _write(tmp_path, json.dumps(doc))
    loaded = cache.load(key(), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert (loaded.status, loaded.reason) == ("other versions", why)


def test_a_table_of_another_driver_is_other_versions_and_of_another_memory_another_key(tmp_path):
    cache.save(_table([10, 10], [5, 5]), str(tmp_path))
    loaded = cache.load(key(driver="590.0"), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "other versions" and "driver '580.1' -> '590.0'" in loaded.reason
    loaded = cache.load(key(memory="host"), hidden=7168, dtype="bfloat16", folder=str(tmp_path))
    assert loaded.status == "another key" and "memory" in loaded.reason
    assert "ignored: another key" in loaded.describe()


def test_a_table_of_another_hidden_size_or_dtype_does_not_cover(tmp_path):
    cache.save(_table([10, 10], [5, 5]), str(tmp_path))
    assert cache.load(key(), hidden=7168, dtype="bfloat16", kinds=("plain",), folder=str(tmp_path)).ok
    loaded = cache.load(key(), hidden=7168, dtype="float16", kinds=("plain",), folder=str(tmp_path))
    assert loaded.status == "does not cover" and "no float16 plain routes" in loaded.reason


def test_find_tables_reads_every_table_in_the_folder(tmp_path):
    cache.save(_table([10, 10], [5, 5]), str(tmp_path))
    (tmp_path / "routes_tp4_h1_deadbeef.json").write_text("{")
    (tmp_path / "cluster_check.json").write_text("{}")
    found = cache.find_tables(str(tmp_path))
    assert sorted(f.status for f in found) == ["corrupt", "ok"]


def test_routing_imports_without_torch():
    # Routing tables, the dispatch policy and the tuner's choice of candidates are data: none of them may pull in
    # torch.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import sglang_sm120.routing.cache, sglang_sm120.routing.table, sglang_sm120.routing.book\n"
            "import sgl_kernel_sm120.policy, sglang_sm120.tuning.candidates\n"
            "import sglang_sm120.routing.render, sglang_sm120.core.nccl\n"
            "print('ok')")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "python")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_blames_are_kept_per_box_and_key_and_merged():
    from sglang_sm120.routing.table import make_key

    local = [{"uuid": "GPU-0", "driver": "580"}, {"uuid": "GPU-1", "driver": "580"}]
    key = make_key(local, islands=None, p2p=None, memory="device")
    newer = make_key([dict(f, driver="590") for f in local], islands=None, p2p=None, memory="device")
    one = {"dtype": "bfloat16", "kind": "fused", "candidate": "sm120/ONESHOT/pull/device", "from_bytes": 28672,
           "reason": "exit code -9 while running it"}
    assert cache.blames(key) == []
    path = cache.record_blames(key, [one], "2026-12-03 10:00:00")
    cache.record_blames(key, [dict(one, from_bytes=14336)], "2026-12-03 11:00:00")
    assert [(b["candidate"], b["from_bytes"], b["when"]) for b in cache.blames(key)] == [
        ("sm120/ONESHOT/pull/device", 14336, "2026-12-03 10:00:00")]
    assert cache.blames(newer) == []  # another driver: another key, the blame does not apply
    assert path == cache.blame_path(newer) and cache.find_tables() == []  # not a table
