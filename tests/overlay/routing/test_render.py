"""Markdown of a routing table and of benchmark results."""

from __future__ import annotations

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


def test_cells_cannot_break_the_table():
    assert render._md_table(["a"], [["x|y\nz"]]).splitlines()[-1] == "| x\\|y z |"
