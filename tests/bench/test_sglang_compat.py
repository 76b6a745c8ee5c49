"""bench_verify --via-sglang against the installed SGLang release: which gate and which group set-up it uses."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from benchmarks.workloads import sglang_compat  # noqa: E402
from tests.sglang_versions import installed_sglang  # noqa: E402


def test_gate_and_group_setup_match_the_installed_release():
    import importlib

    gate = sglang_compat.fusion_gate()
    if installed_sglang() == "0.5.13.post1":
        assert gate is importlib.import_module("sglang.srt.layers.communicator").apply_flashinfer_allreduce_fusion
        assert not sglang_compat.uses_published_widths()
    elif installed_sglang() == "0.5.23":
        # the by-name copy that the fused norm inputs call (defined in residual/add_norm.py)
        module = importlib.import_module("sglang.srt.layers.layer_boundary.fusions.allreduce")
        assert gate is module.flashinfer_ar_fusion_applies
        assert sglang_compat.uses_published_widths()
    else:
        pytest.fail(f"no expectation for sglang {installed_sglang()}")


def test_the_gate_seen_after_activation_is_the_overlays(overlay):
    from sglang_sm120.seams import base

    assert base.is_ours(sglang_compat.fusion_gate())
