"""The kernel package's switches (sgl_kernel_sm120/settings.py): read once, under both spellings (SGLang tells a user
who sets SGL_SM120_X to use SGLANG_SM120_X, and a switch must not be ignored for following it), two values an error
also after SGLang's copy, every bad value a one-line error naming the variable, its value and what is allowed; and
no other module reads the environment."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kernel_sm120 import settings as settings_module
from sgl_kernel_sm120.settings import (
    VARIABLES,
    KernelSettings,
    ProbeDrop,
    SettingError,
    choice,
    count,
    folder,
    launch_switches,
    lookup,
    read,
    seconds,
    spellings,
)
from tests.support.env import spelled_out

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_set_is_the_defaults():
    settings = read({})
    assert settings == KernelSettings()
    assert (settings.timeout_s, settings.warn_after_s, settings.abort_after_s) == (300.0, 5.0, 30.0)
    assert settings.pdl and settings.fused_clusters and settings.shm_dir == "/dev/shm" and not settings.library
    assert settings.cache_dir == os.path.expanduser("~/.cache/sglang_sm120")


def test_every_setting_has_both_spellings_whichever_it_is_named_by():
    assert spellings("SGL_SM120_AR_PDL") == spellings("SGLANG_SM120_AR_PDL") == ("SGL_SM120_AR_PDL",
                                                                               "SGLANG_SM120_AR_PDL")
    assert spellings("SGLANG_SM120_CACHE") == ("SGL_SM120_CACHE", "SGLANG_SM120_CACHE")
    assert spelled_out("SGL_SM120_AR_PDL", "0") == {"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "0"}


@pytest.mark.parametrize("field, value, expected", [
    ("timeout_s", "7", 7.0),
    ("warn_after_s", "0.5", 0.5),
    ("abort_after_s", "0", 0.0),
    ("pdl", "0", False),
    ("fused_clusters", "OFF", False),
    ("shm_dir", "/", "/"),
    ("library", "/tmp/lib.so", "/tmp/lib.so"),
    ("debug_cluster_check", "trap", "trap"),
    ("debug_probe_drop", "1:0:read@any", ProbeDrop(1, 0, "read", "any")),
    ("debug_probe_drop", "1:0:last", ProbeDrop(1, 0, "last", "device")),
    ("debug_probe_drop", "1:0@host", ProbeDrop(1, 0, None, "host")),
    ("debug_shm_no_precheck", "1", True),
])
@pytest.mark.parametrize("legacy", [True, False])
def test_every_switch_is_read_under_either_spelling(field, value, expected, legacy, monkeypatch):
    if field == "shm_dir":
        monkeypatch.setattr(os, "access", lambda path, mode: True)  # any user's test run: a folder it may write
    name = spellings(VARIABLES[field])[0 if legacy else -1]
    assert getattr(read({name: value}), field) == expected


def test_the_settings_say_which_switches_were_set():
    assert read({}).given == frozenset()
    given = read({"SGLANG_SM120_AR_TIMEOUT_S": "300", "SGL_SM120_AR_PDL": "1", "SGL_SM120_SHM_DIR": " "}).given
    assert given == {"timeout_s", "pdl"}  # set to the default is set; empty is unset


def test_a_home_folder_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read({"SGL_SM120_CACHE": "~/tables"}).cache_dir == str(tmp_path / "tables")


def test_the_shared_memory_folder_must_exist_and_the_cache_may_be_new_inside_a_writable_folder(tmp_path):
    """A folder that does not exist used to be taken, and failed only when a workspace or a table was written."""
    assert read({"SGL_SM120_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)
    missing = tmp_path / "no" / "such"
    with pytest.raises(SettingError) as caught:
        read({"SGLANG_SM120_SHM_DIR": str(missing)})
    assert str(caught.value) == f"SGLANG_SM120_SHM_DIR={str(missing)!r}: an existing folder this user can write"
    assert read({"SGLANG_SM120_CACHE": str(missing)}).cache_dir == str(missing)  # made when first written
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    for name, value in (("SGLANG_SM120_CACHE", blocked / "tables"), ("SGL_SM120_SHM_DIR", blocked)):
        with pytest.raises(SettingError, match=f"^{name}='{value}': an existing folder this user can write"):
            read({name: str(value)})


def test_a_folder_this_user_cannot_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a user who may not write there (root may)
    with pytest.raises(SettingError, match="SGLANG_SM120_CACHE=.*: an existing folder this user can write, or a new"):
        read({"SGLANG_SM120_CACHE": str(tmp_path / "new")})
    with pytest.raises(SettingError, match="SGL_SM120_SHM_DIR=.*: an existing folder this user can write"):
        read({"SGL_SM120_SHM_DIR": str(tmp_path)})


def test_the_same_value_twice_is_fine_and_two_values_are_an_error_naming_both():
    assert read({"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "0"}).pdl is False
    assert read({"SGL_SM120_AR_PDL": "", "SGLANG_SM120_AR_PDL": "0"}).pdl is False  # empty is unset
    with pytest.raises(SettingError) as caught:
        read({"SGLANG_SM120_AR_PDL": "1", "SGL_SM120_AR_PDL": "0"})
    assert str(caught.value) == "SGL_SM120_AR_PDL='0' and SGLANG_SM120_AR_PDL='1' are one setting at two values: " \
                                "unset one of them"


def test_two_values_are_found_after_sglangs_copy_made_them_equal(monkeypatch):
    """SGLang copies SGL_X over SGLANG_X when imported, before any code of ours runs; the environment the process
    was started with still holds what the user set."""
    started = {"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "1"}
    monkeypatch.setattr(settings_module, "_started_with", lambda: started)
    for name in started:
        monkeypatch.setenv(name, "0")  # after the copy
    with pytest.raises(SettingError, match="SGL_SM120_AR_PDL='0' and SGLANG_SM120_AR_PDL='1' are one setting"):
        read()
    assert read(dict(os.environ)).pdl is False  # a mapping handed in is taken as it is
    monkeypatch.setenv("SGL_SM120_AR_PDL", "1")  # the process changed both itself since: its own values count
    monkeypatch.setenv("SGLANG_SM120_AR_PDL", "1")
    assert read().pdl is True
    started["SGLANG_SM120_AR_PDL"] = "0"
    monkeypatch.setenv("SGL_SM120_AR_PDL", "0")
    monkeypatch.setenv("SGLANG_SM120_AR_PDL", "0")
    assert lookup("SGL_SM120_AR_PDL") == ("SGL_SM120_AR_PDL", "0")


def test_the_environment_a_process_started_with_is_read_from_the_system():
    code = ("import os; from sgl_kernel_sm120 import settings; os.environ['SM120_PROBE'] = 'changed'; "
            "print(settings._started_with().get('SM120_PROBE'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SM120_PROBE": "as started", "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "as started", done.stderr[-2000:]


@pytest.mark.parametrize("name, value, allowed", [
    ("SGL_SM120_AR_TIMEOUT_S", "1e10", "a number of seconds > 0, at most 1e+09"),
    ("SGL_SM120_AR_TIMEOUT_S", "-5", "a number of seconds > 0"),
    ("SGL_SM120_AR_TIMEOUT_S", "0", "a number of seconds > 0"),
    ("SGLANG_SM120_AR_TIMEOUT_S", "soon", "a number of seconds > 0"),
    ("SGL_SM120_AR_TIMEOUT_S", "nan", "a number of seconds > 0"),
    ("SGL_SM120_AR_WARN_S", "inf", "a number of seconds > 0"),
    ("SGL_SM120_AR_ABORT_AFTER_S", "-1", "a number of seconds >= 0 (0: off)"),
    ("SGL_SM120_AR_PDL", "yes", "one of 1, 0"),
    ("SGL_SM120_FUSED_CLUSTERS", "maybe", "one of auto, off"),
    ("SGL_SM120_DEBUG_CLUSTER_CHECK", "crash", "one of trap"),
    ("SGL_SM120_DEBUG_SHM_NO_PRECHECK", "true", "one of 1, 0"),
    ("SGL_SM120_DEBUG_PROBE_DROP", "1-0", "SRC:DST"),
    ("SGL_SM120_DEBUG_PROBE_DROP", "1:0@p2p", "@device (the default), @host or @any"),
    ("SGL_SM120_DEBUG_PROBE_DROP", "1:0:reads", "SRC:DST:write|read|last"),
    ("SGL_SM120_DEBUG_PROBE_DROP", "1:0:5", "SRC:DST:write|read|last"),  # rounds are gone: one round
    ("SGL_SM120_DEBUG_PROBE_DROP", "1:0:read:2", "SRC:DST:write|read|last"),
    ("SGL_SM120_DEBUG_PROBE_DROP", "1:read", "SRC:DST:write|read|last"),
])
def test_a_bad_value_is_one_line_naming_the_variable_its_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(SettingError) as caught:
        read({name: value})
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{name}={value!r}: ") and allowed in text, text
    assert isinstance(caught.value, ValueError)


def test_the_parser_family_says_what_each_takes():
    assert choice(("a", "b"), "why")("X", "B") == "b" and choice({"on": 1})("X", " ON ") == 1
    with pytest.raises(SettingError, match=r"^X='c': one of a, b \(why\)$"):
        choice(("a", "b"), "why")("X", "c")
    assert seconds(most=60)("X", "60") == 60.0
    with pytest.raises(SettingError, match=r"^X='61': a number of seconds > 0, at most 60$"):
        seconds(most=60)("X", "61")
    assert count(16, 32)("X", "0x10") == 16 and count(1)("X", 5) == 5
    for bad in ("15", "33", "1.5", "x", True):
        with pytest.raises(SettingError, match=f"^X={bad!r}: an integer from 16 to 32$"):
            count(16, 32)("X", bad)
    with pytest.raises(SettingError, match=r"^--hidden='-1': the hidden size >= 1, or so$"):
        count(1, what="the hidden size", also="or so")("--hidden", "-1")
    with pytest.raises(SettingError, match="X='/no/such/folder': an existing folder"):
        folder()("X", "/no/such/folder")


def test_an_empty_value_is_unset():
    assert read({"SGL_SM120_AR_TIMEOUT_S": " ", "SGL_SM120_SHM_DIR": ""}) == KernelSettings()


def test_the_launch_switches_are_normalised_so_unset_and_the_default_key_alike():
    assert launch_switches(read({})) == launch_switches(read({"SGLANG_SM120_AR_PDL": "1"})) == {
        "SGL_SM120_AR_PDL": "1", "SGL_SM120_FUSED_CLUSTERS": "auto"}
    assert launch_switches(read({"SGL_SM120_FUSED_CLUSTERS": "off", "SGL_SM120_AR_PDL": "0"})) == {
        "SGL_SM120_AR_PDL": "0", "SGL_SM120_FUSED_CLUSTERS": "off"}


def _is_os_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def test_no_module_of_the_kernel_package_reads_the_environment_but_settings_py():
    """A lookup anywhere else would see one spelling only, and would escape the one-line errors. Handing os.environ
    on whole (a child's environment) looks nothing up."""
    offenders = []
    for path in sorted((ROOT / "sgl_kernel_sm120").glob("*.py")):
        if path.name == "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            looked_up = (
                (isinstance(node, ast.Subscript) and _is_os_environ(node.value))
                or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (_is_os_environ(node.func.value) or (node.func.attr == "getenv"
                         and isinstance(node.func.value, ast.Name) and node.func.value.id == "os")))
                or (isinstance(node, ast.Compare) and any(_is_os_environ(c) for c in node.comparators))
                or (isinstance(node, ast.Attribute) and node.attr in ("getenv", "environb"))
            )
            if looked_up:
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], offenders


def test_after_sglang_rewrites_a_legacy_switch_both_spellings_agree():
    """SGLang 0.5.23 copies SGL_* to SGLANG_* at import (and warns); the kernel package then reads one value."""
    sglang = pytest.importorskip("sglang")
    code = ("import warnings; warnings.simplefilter('ignore'); import sglang.srt.environ, os; "
            "from sgl_kernel_sm120.settings import read; "
            "print(os.environ.get('SGLANG_SM120_AR_TIMEOUT_S'), read().timeout_s)")
    env = dict(os.environ, SGL_SM120_AR_TIMEOUT_S="42", PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    env.pop("SGLANG_SM120_AR_TIMEOUT_S", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    copied, value = done.stdout.split()[-2:]
    assert value == "42.0"
    if sglang.__version__ == "0.5.23":
        assert copied == "42"  # the rewrite the two spellings exist for
