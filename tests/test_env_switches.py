"""The kernel package's switches are read under both prefixes (sgl_kernel_sm120/env.py): SGLang 0.5.23 tells a
user who sets SGL_SM120_X to "please use SGLANG_SM120_X", and a switch must not be ignored for following it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kernel_sm120 import cluster_check, data_path_probe, watchdog
from sgl_kernel_sm120.env import setting, spelled_out, spellings

ROOT = Path(__file__).resolve().parents[1]


def test_a_switch_has_both_spellings_and_other_names_one():
    assert spellings("SGL_SM120_AR_PDL") == ("SGL_SM120_AR_PDL", "SGLANG_SM120_AR_PDL")
    assert spellings("SGLANG_SM120_CACHE") == ("SGLANG_SM120_CACHE",)  # SGLang copies one way only
    assert spellings("NCCL_DEBUG") == ("NCCL_DEBUG",)
    assert spelled_out("SGL_SM120_AR_PDL", "0") == {"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "0"}


def test_either_spelling_is_read_the_same_value_twice_is_fine_and_two_values_are_an_error():
    assert setting("SGL_SM120_AR_PDL", "1", {}) == "1"
    assert setting("SGL_SM120_AR_PDL", "1", {"SGL_SM120_AR_PDL": "0"}) == "0"
    assert setting("SGL_SM120_AR_PDL", "1", {"SGLANG_SM120_AR_PDL": "0"}) == "0"
    assert setting("SGL_SM120_AR_PDL", "1", {"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "0"}) == "0"
    with pytest.raises(ValueError, match="SGL_SM120_AR_PDL='0' and SGLANG_SM120_AR_PDL='1' are one switch"):
        setting("SGL_SM120_AR_PDL", "1", {"SGL_SM120_AR_PDL": "0", "SGLANG_SM120_AR_PDL": "1"})


def test_the_switches_take_effect_under_the_name_sglang_recommends():
    assert watchdog.seconds_from_env(watchdog.TIMEOUT_ENV, 600.0, {"SGLANG_SM120_AR_TIMEOUT_S": "7"}) == 7.0
    verdict = cluster_check.verdict_for(0, "GPU-a", "/lib.so", {"SGLANG_SM120_FUSED_CLUSTERS": "off"})
    assert not verdict.ok and verdict.source == "off" and "switched off" in verdict.reason
    assert data_path_probe.drop_target(1, {"SGLANG_SM120_DEBUG_PROBE_DROP": "1:0"}) == 0
    assert data_path_probe.drop_target(1, {}) == -1


def test_the_overlay_reads_the_kernel_timeout_and_the_key_switches_under_either_spelling(monkeypatch):
    from sglang_sm120.core import config, facts

    assert config.kernel_timeout_s(None, {"SGLANG_SM120_AR_TIMEOUT_S": "30"}) is None  # the kernels read it

    class Workspace:
        fused_clusters = {"clusters": [2]}
        sm_budget = 188
        use_pdl = False

    found = []
    for spelling in ("SGL_SM120_AR_PDL", "SGLANG_SM120_AR_PDL"):
        with monkeypatch.context() as m:
            m.setenv(spelling, "0")
            found.append(facts.launch_facts(Workspace()))
    assert found[0] == found[1] and found[0]["switches"]["SGL_SM120_AR_PDL"] == "0"  # one table key either way


def _is_os_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def test_no_module_of_the_kernel_package_looks_up_a_variable_past_env_py():
    """A lookup in os.environ (or os.getenv) elsewhere would see one spelling only. Handing os.environ on whole,
    to env.setting or as a child's environment, looks nothing up."""
    offenders = []
    for path in sorted((ROOT / "sgl_kernel_sm120").glob("*.py")):
        if path.name == "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            looked_up = (
                (isinstance(node, ast.Subscript) and _is_os_environ(node.value))
                or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (_is_os_environ(node.func.value) or (node.func.attr == "getenv"
                         and isinstance(node.func.value, ast.Name) and node.func.value.id == "os")))
                or (isinstance(node, ast.Compare) and any(_is_os_environ(c) for c in node.comparators))
            )
            if looked_up:
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], offenders


def test_after_sglang_rewrites_a_legacy_switch_both_spellings_agree():
    """SGLang 0.5.23 copies SGL_* to SGLANG_* at import (and warns); the kernel package then reads one value."""
    sglang = pytest.importorskip("sglang")
    code = ("import warnings; warnings.simplefilter('ignore'); import sglang.srt.environ, os; "
            "from sgl_kernel_sm120.env import setting; "
            "print(os.environ.get('SGLANG_SM120_AR_TIMEOUT_S'), setting('SGL_SM120_AR_TIMEOUT_S'))")
    env = dict(os.environ, SGL_SM120_AR_TIMEOUT_S="42",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    env.pop("SGLANG_SM120_AR_TIMEOUT_S", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    copied, read = done.stdout.split()[-2:]
    assert read == "42"
    if sglang.__version__ == "0.5.23":
        assert copied == "42"  # the rewrite this module exists for
