"""Settings: parsing, environment equivalents, the derived dispatch bound."""

from __future__ import annotations

import pytest

from sglang_sm120 import config


def test_parse_mode():
    assert config.parse_mode("ON", "x") == "on"
    with pytest.raises(ValueError, match="auto, on, off"):
        config.parse_mode("yes", "SGLANG_SM120_ALLREDUCE")


@pytest.mark.parametrize(
    "raw,expected", [(None, None), ("", None), ("auto", None), ("65536", 65536), ("0x1000", 4096), (7, 7)]
)
def test_parse_max_bytes(raw, expected):
    assert config.parse_max_bytes(raw, "x") == expected


@pytest.mark.parametrize("raw", ["-1", "0", "lots", 0, True])
def test_parse_max_bytes_rejects(raw):
    with pytest.raises(ValueError):
        config.parse_max_bytes(raw, "x")


def test_env_equivalents():
    assert config.mode_from_env({}) == "auto"
    assert config.mode_from_env({config.MODE_ENV: "off"}) == "off"
    assert config.max_bytes_from_env({config.MAX_BYTES_ENV: "1024"}) == 1024
    assert config.max_bytes_from_env({}) is None
    with pytest.raises(ValueError, match=config.MODE_ENV):
        config.mode_from_env({config.MODE_ENV: "sometimes"})


def test_settings_prefer_server_args_then_env():
    class Args:
        sm120_allreduce = "on"
        sm120_allreduce_max_bytes = 2048

    env = {config.MODE_ENV: "off", config.MAX_BYTES_ENV: "4096"}
    assert config.settings_from_server_args(Args(), env) == config.OverlaySettings("on", 2048)
    assert config.settings_from_server_args(object(), env) == config.OverlaySettings("off", 4096)
    assert config.settings_from_server_args(None, {}) == config.OverlaySettings("auto", None)


def test_derived_bound_eagle_verify():
    bound = config.derive_max_bytes(
        hidden_size=7168, element_size=2, cuda_graph_max_bs=8, speculative_num_draft_tokens=4,
        speculative_algorithm="EAGLE3",
    )
    assert bound.max_bytes == 8 * 4 * 7168 * 2
    assert "8" in bound.explanation and "7168" in bound.explanation


def test_derived_bound_without_speculation_ignores_draft_tokens():
    bound = config.derive_max_bytes(hidden_size=7168, element_size=2, cuda_graph_max_bs=16,
                                    speculative_num_draft_tokens=4, speculative_algorithm=None)
    assert bound.max_bytes == 16 * 7168 * 2


def test_derived_bound_uses_largest_capture_size():
    bound = config.derive_max_bytes(
        hidden_size=1024, element_size=2, cuda_graph_max_bs=None, cuda_graph_bs=[1, 2, 24, 8]
    )
    assert bound.max_bytes == 24 * 1024 * 2


def test_derived_bound_without_batch_sizes():
    bound = config.derive_max_bytes(hidden_size=1024, element_size=2)
    assert bound.max_bytes == config.FALLBACK_MAX_TOKENS * 1024 * 2


def test_derived_bound_is_capped_to_whole_rows():
    bound = config.derive_max_bytes(hidden_size=7168, element_size=2, cuda_graph_max_bs=512,
                                    speculative_num_draft_tokens=4, speculative_algorithm="EAGLE3")
    assert bound.max_bytes <= config.DERIVED_MAX_BYTES_CAP
    assert bound.max_bytes % (7168 * 2) == 0
    assert "capped" in bound.explanation


def test_explicit_bound_wins_and_is_not_capped():
    class Args:
        cuda_graph_max_bs = 8

    bound = config.resolve_max_bytes(64 << 20, Args(), 7168, 2)
    assert bound.max_bytes == 64 << 20
    derived = config.resolve_max_bytes(None, Args(), 7168, 2)
    assert derived.max_bytes == 8 * 7168 * 2
