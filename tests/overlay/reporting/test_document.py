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
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "something else"}))
    found = document.read_results([RESULTS + "/allreduce_h200_tp2.json", str(tmp_path)])
    by_name = {os.path.basename(e["path"]): e for e in found}
    assert by_name["allreduce_h200_tp2.json"]["kind"] == "allreduce"
    assert "JSONDecodeError" in by_name["broken.json"]["error"]
    assert "not a result document this repository writes" in by_name["other.json"]["error"]


def test_every_result_json_the_repository_writes_is_taken_and_the_rest_listed_at_the_end():
    found = document.read_results([RESULTS])
    kinds = {os.path.basename(e["path"]): e.get("kind") or e["error"] for e in found}
    jsons = sorted(name for name in os.listdir(RESULTS) if name.endswith(".json"))
    assert sorted(name for name, kind in kinds.items() if kind in document.RESULT_KINDS) == jsons, kinds
    assert kinds["transports_h200_loopback.json"] == "transports" and kinds["polling_h200_loopback.json"] == "polling"
    assert kinds["tune_h200_shared.json"] == "routing table" and kinds["trap_delivery_h200_w8.json"] == "trap delivery"
    assert kinds["server_test_h200_shared_call4.json"] == "server test"
    others = sorted(name for name in os.listdir(RESULTS) if not name.endswith(".json"))
    assert sorted(n for n, k in kinds.items() if k == "not a JSON result document") == others
    report = document.build(env=fake_env(), doctor=None, tables=[], results=found, created="2026-12-03")
    text = document.markdown(report, results=found)
    assert "#### transports_h200_loopback.json: bench_transports" in text and "best_us" in text
    assert "#### polling_h200_loopback.json: bench_polling" in text and "rule_over_one_cta" in text
    assert "### tune_h200_shared.json (routing table)" in text and "trap delivery, 8 ranks" in text
    assert "server_test_h200_shared_call4.json: real SGLang 0.5.13.post1 server" in text
    assert "- passed: on, graphs: CUDA graphs captured" in text and "- FAILED: on, graphs: sglang.bench" in text
    skipped = text.split("### Skipped", 1)[1]
    assert all(f"{name}`: not a JSON result document" in skipped for name in others)
    assert text.index("### Skipped") > text.index("<details><summary>JSON</summary>")


def test_the_host_name_is_replaced_as_a_word_only():
    text = "host vm, nested_pvm=1, vm.example.com, vm-2 and kvm stay; (vm)"
    assert document.redact_host(text, host="vm") == \
        "host <host>, nested_pvm=1, <host>.example.com, vm-2 and kvm stay; (<host>)"
    assert document.redact_host("gpu-box-1: gpu-box", host="gpu-box") == "gpu-box-1: <host>"


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
    assert f"wrote the report to {out}: " in capsys.readouterr().out


def test_the_default_report_file_is_named_with_its_full_path(tmp_path, monkeypatch, capsys):
    from sglang_sm120 import report

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(document, "_run", lambda command, timeout=30.0: None)
    monkeypatch.chdir(tmp_path)
    assert report.main(["--no-doctor", "--results", str(tmp_path / "missing.json")]) == 0
    out, err = capsys.readouterr()
    assert f"wrote the report to {tmp_path / 'sglang_sm120_report.md'} (--out FILE writes it elsewhere)" in out
    assert f"skipped {tmp_path / 'missing.json'}: FileNotFoundError" in err


def test_a_saved_doctor_output_is_used_as_given(tmp_path, monkeypatch):
    from sglang_sm120 import report

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(document, "_run", lambda command, timeout=30.0: None)
    saved = tmp_path / "doctor.txt"
    saved.write_text("the sm120 all-reduce backend can run here")
    assert report.main(["--doctor-output", str(saved), "--out", str(tmp_path / "r.md")]) == 0
    assert "the sm120 all-reduce backend can run here" in (tmp_path / "r.md").read_text()
