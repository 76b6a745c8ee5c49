"""Markdown of a routing table and of benchmark results."""

from __future__ import annotations

import json
import os

from sglang_sm120.routing import render

from ..routing.test_table import _table

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "results")


def test_a_table_shows_its_routes_its_times_with_the_routed_one_in_bold_and_its_failures():
    table = _table([10, 10, 10], [5, 5, None])
    text = render.table_markdown(table, path="/cache/routes.json")
    assert "| bfloat16 | plain | 1 | 28672 | ONESHOT/push/device |" in text
    assert "| bfloat16 | plain | 28673 | 43008 | NCCL |" in text
    assert "| 1 | 14336 | 10.00 | **5.00** |" in text
    assert "| 3 | 43008 | **10.00** | failed |" in text
    assert "- ONESHOT/push/device (bfloat16 plain rows 3): timed out" in text
    assert "file `/cache/routes.json`" in text and "TP size 2" in text and "CUDA P2P: every pair" in text


def test_the_committed_benchmark_results_render():
    with open(os.path.join(RESULTS, "allreduce_h200_tp2.json")) as handle:
        text = render.allreduce_doc_markdown(json.load(handle))
    assert text.startswith("allreduce, us per call:") and "| rows |" in text
    with open(os.path.join(RESULTS, "verify_h200_tp2.json")) as handle:
        doc = json.load(handle)
    text = render.verify_doc_markdown(doc)
    assert "compute gemm, us per verify forward:" in text
    assert render.hardware_line(doc).startswith("NVIDIA H200 x2, driver 580.159.04")


def test_cells_cannot_break_the_table():
    assert render.md_table(["a"], [["x|y\nz"]]).splitlines()[-1] == "| x\\|y z |"


def test_repeated_skip_reasons_are_listed_once():
    doc = {"results": [], "skipped": [{"impl": "sm120", "reason": "no islands"}] * 3 + [{"impl": "x", "reason": "y"}]}
    assert render.allreduce_doc_markdown(doc) == "Skipped: sm120: no islands; x: y"
