"""The report: what it gathers, how it reads results, and that it stays offline."""

from __future__ import annotations

import json
import os

from sglang_sm120.reporting import document
from sglang_sm120.routing import cache

from ..routing.test_table import _table

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "results")


def fake_env():
    return document.environment(run=lambda command: f"(ran {command[0]} {command[1]})")


def test_result_documents_are_read_validated_and_the_rest_named(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "polling"}))
    found = document.read_results([RESULTS + "/allreduce_h200_tp2.json", str(tmp_path)])
    by_name = {os.path.basename(e["path"]): e for e in found}
    assert by_name["allreduce_h200_tp2.json"]["kind"] == "allreduce"
    assert "JSONDecodeError" in by_name["broken.json"]["error"]
    assert "not a bench_allreduce or bench_verify result" in by_name["other.json"]["error"]


def test_the_report_holds_environment_doctor_tables_and_results_with_its_json_attached(tmp_path):
    good = cache.save(_table([10, 10], [5, 5]), str(tmp_path))
    (tmp_path / "routes_tp8_h7168_00000000.json").write_text("{")
    tables = cache.find_tables(str(tmp_path))
    results = document.read_results([RESULTS + "/verify_h200_tp2.json"])
    doctor = {"command": "-m sglang_sm120.doctor", "exit_code": 0, "output": "host myhost, python 3.11\nok"}
    report = document.build(env=fake_env(), doctor=doctor, tables=tables, results=results, created="2026-12-03")
    text = document.redact_host(document.markdown(report, tables=tables, results=results), host="myhost")
    assert "myhost" not in text and "host <host>, python 3.11" in text
    assert "(ran nvidia-smi --query-gpu" in text
    assert f"### {os.path.basename(good)}" in text and "ONESHOT/push/device" in text
    assert "routes_tp8_h7168_00000000.json`: corrupt (bad JSON" in text
    assert "#### verify_h200_tp2.json: NVIDIA H200 x2" in text
    attached = json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert attached["created"] == "2026-12-03" and attached["doctor"]["exit_code"] == 0
    assert attached["tables"][0]["table"]["key"]["world_size"] == 2
    slim = attached["results"][0]
    assert slim["kind"] == "verify" and set(slim["results"][0]) <= set(document.VERIFY_FIELDS)
    assert len(text) < document.ISSUE_LIMIT_CHARS


def test_without_tables_or_results_the_report_says_what_to_run(tmp_path):
    report = document.build(env=fake_env(), doctor=None, tables=[], results=[])
    text = document.markdown(report)
    assert "(not run: --no-doctor)" in text and "run `python -m sglang_sm120.tune`" in text
    assert "none given (`--results" in text


def test_the_entry_writes_one_file_without_running_the_doctor(tmp_path, monkeypatch, capsys):
    from sglang_sm120 import report

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(document, "_run", lambda command, timeout=30.0: None)
    out = tmp_path / "r.md"
    assert report.main(["--no-doctor", "--out", str(out), "--results", RESULTS + "/allreduce_h200_tp2.json"]) == 0
    text = out.read_text()
    assert text.startswith("## sglang-sm120 report") and "allreduce, us per call:" in text
    assert "please send it with your issue" in capsys.readouterr().err


def test_a_saved_doctor_output_is_used_as_given(tmp_path, monkeypatch):
    from sglang_sm120 import report

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(document, "_run", lambda command, timeout=30.0: None)
    saved = tmp_path / "doctor.txt"
    saved.write_text("the sm120 all-reduce backend can run here")
    assert report.main(["--doctor-output", str(saved), "--out", str(tmp_path / "r.md")]) == 0
    assert "the sm120 all-reduce backend can run here" in (tmp_path / "r.md").read_text()
