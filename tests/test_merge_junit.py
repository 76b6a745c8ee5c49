"""scripts/merge_junit.py: the one junit file a GPU suite run commits."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "merge_junit.py"
SUITE = '<testsuite name="pytest" tests="{t}" failures="{f}" errors="0" skipped="{s}" time="1.5"><testcase name="a"/>' \
        '</testsuite>'


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)


def test_suites_are_merged_with_summed_counters_and_labels(tmp_path):
    (tmp_path / "a.xml").write_text(SUITE.format(t=3, f=0, s=0))
    (tmp_path / "b.xml").write_text(f"<testsuites>{SUITE.format(t=2, f=1, s=0)}</testsuites>")
    done = _run(tmp_path, "out.xml", "a.xml", "second run=b.xml")
    assert done.returncode == 0, done.stderr
    root = ET.parse(tmp_path / "out.xml").getroot()
    assert (root.get("tests"), root.get("failures"), root.get("time")) == ("5", "1", "3.000")
    assert [s.get("name") for s in root] == ["pytest", "second run"]


def test_a_missing_input_is_an_error_suite_and_strict_fails_on_it_or_on_a_skip(tmp_path):
    (tmp_path / "ok.xml").write_text(SUITE.format(t=1, f=0, s=0))
    (tmp_path / "skip.xml").write_text(SUITE.format(t=1, f=0, s=1))
    done = _run(tmp_path, "--strict", "out.xml", "ok.xml", "crashed=missing.xml")
    assert done.returncode == 1
    root = ET.parse(tmp_path / "out.xml").getroot()
    assert root.get("errors") == "1" and root[1].get("name") == "crashed"
    assert _run(tmp_path, "--strict", "o2.xml", "skip.xml").returncode == 1
    assert _run(tmp_path, "--strict", "o3.xml", "ok.xml").returncode == 0
    assert _run(tmp_path, "o4.xml", "skip.xml").returncode == 0  # not strict: recorded, not refused
