"""Settings: parsing, environment equivalents, the derived dispatch bound."""

from __future__ import annotations

import pytest

from sglang_sm120.core import config


def test_parse_mode():
    assert config.parse_mode("x", "ON") == "on"
    with pytest.raises(ValueError, match="auto, on, off"):
        config.parse_mode("SGLANG_SM120_ALLREDUCE", "yes")


@pytest.mark.parametrize(
    "raw,expected",
    [(None, None), ("", None), ("auto", None), ("65536", 65536), ("0x1000", 4096), (16, 16), (64 << 20, 64 << 20)],
)
def test_parse_max_bytes(raw, expected):
    assert config.parse_max_bytes("x", raw) == expected


@pytest.mark.parametrize("raw", ["-5", "0", "abc", "99999999999", "15", 0, True, "1.5"])
def test_parse_max_bytes_rejects_with_one_line_naming_the_source(raw):
    with pytest.raises(config.SettingError) as caught:
        config.parse_max_bytes("SOME_SOURCE", raw)
    assert str(caught.value) == f"SOME_SOURCE={raw!r}: a byte count from {config.MIN_MAX_BYTES} to " \
        f"{config.MAX_EXPLICIT_BYTES}, or auto (derived from the captured batch sizes)"


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="launch_server")
    config.add_cli_args(parser)
    return parser


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--sm120-allreduce-max-bytes", "-5"], "--sm120-allreduce-max-bytes='-5': a byte count from 16"),
        (["--sm120-allreduce-max-bytes", "abc"], "--sm120-allreduce-max-bytes='abc': a byte count from 16"),
        (["--sm120-allreduce-max-bytes", "0"], "--sm120-allreduce-max-bytes='0': a byte count from 16"),
        (["--sm120-allreduce-max-bytes", "99999999999"], "--sm120-allreduce-max-bytes='99999999999': a byte count"),
        (["--sm120-allreduce", "maybe"], "--sm120-allreduce='maybe': one of auto, on, off"),
        (["--sm120-allreduce-tune", "on"], "--sm120-allreduce-tune='on': one of auto, off, force (auto: tune"),
    ],
)
def test_bad_flag_values_get_our_message_not_argparse_lambda(argv, needle, capsys):
    with pytest.raises(SystemExit) as caught:
        _parser().parse_args(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "<lambda>" not in err and "invalid" not in err.split(needle)[0].splitlines()[-1], err


def test_a_bad_flag_value_is_one_line_without_the_usage(capsys):
    with pytest.raises(SystemExit) as caught:
        _parser().parse_args(["--sm120-allreduce=maybe"])
    err = capsys.readouterr().err
    assert caught.value.code == 2
    assert err == "error: argument --sm120-allreduce: --sm120-allreduce='maybe': one of auto, on, off\n", err


def test_a_parser_that_does_not_exit_gets_argparses_error():
    import argparse

    parser = argparse.ArgumentParser(prog="launch_server", exit_on_error=False)
    config.add_cli_args(parser)
    with pytest.raises(argparse.ArgumentError, match="'-5': a byte count from 16"):
        parser.parse_args(["--sm120-allreduce-max-bytes", "-5"])


def test_good_flag_values_parse():
    args = _parser().parse_args(["--sm120-allreduce", "ON", "--sm120-allreduce-max-bytes", "0x10000"])
    assert args.sm120_allreduce == "on" and args.sm120_allreduce_max_bytes == 65536
    assert _parser().parse_args(["--sm120-allreduce-max-bytes", "auto"]).sm120_allreduce_max_bytes is None


@pytest.mark.parametrize(
    "name,value,needle",
    [
        (config.MODE_ENV, "sometimes", "SGLANG_SM120_ALLREDUCE='sometimes': one of auto, on, off"),
        (config.MAX_BYTES_ENV, "-5", "SGLANG_SM120_ALLREDUCE_MAX_BYTES='-5': a byte count from 16 to 67108864, or "
                                     "auto"),
        (config.MAX_BYTES_ENV, "abc", "SGLANG_SM120_ALLREDUCE_MAX_BYTES='abc': a byte count"),
        (config.MAX_BYTES_ENV, "99999999999", "SGLANG_SM120_ALLREDUCE_MAX_BYTES='99999999999': a byte count"),
        (config.AGREEMENT_TIMEOUT_ENV, "soon", "SGLANG_SM120_ALLREDUCE_AGREEMENT_TIMEOUT_S='soon': a number of "
                                               "seconds > 0, at most 3600"),
        (config.AGREEMENT_TIMEOUT_ENV, "0", "SGLANG_SM120_ALLREDUCE_AGREEMENT_TIMEOUT_S='0': a number of seconds"),
        (config.AGREEMENT_TIMEOUT_ENV, "nan", "SGLANG_SM120_ALLREDUCE_AGREEMENT_TIMEOUT_S='nan': a number of"),
        (config.HOSTMEM_ENV, "on", "SGLANG_SM120_HOSTMEM='on': one of auto, off (auto: use pinned host memory"),
        (config.HOSTMEM_ENV, "yes", "SGLANG_SM120_HOSTMEM='yes': one of auto, off"),
        (config.TUNE_ENV, "always", "SGLANG_SM120_ALLREDUCE_TUNE='always': one of auto, off, force"),
        (config.TUNE_TIMEOUT_ENV, "-1", "SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S='-1': a number of seconds > 0"),
        (config.TUNE_TIMEOUT_ENV, "later", "SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S='later': a number of seconds"),
        ("SGL_SM120_ALLREDUCE_TUNE_TIMEOUT_S", "7200", "SGL_SM120_ALLREDUCE_TUNE_TIMEOUT_S='7200': a number of "
                                                       "seconds > 0, at most 3600"),
    ],
)
def test_bad_environment_values_are_one_line_errors(name, value, needle):
    with pytest.raises(config.SettingError) as caught:
        config.settings_from_environment({name: value})
    assert str(caught.value).startswith(needle) and "\n" not in str(caught.value), str(caught.value)


def test_the_environment_is_parsed_into_one_settings_object():
    assert config.settings_from_environment({}) == config.OverlaySettings()
    assert config.settings_from_environment({name: "" for _, name, _ in config.ENVIRONMENT}) == \
        config.OverlaySettings()
    env = {config.MODE_ENV: " OFF ", config.MAX_BYTES_ENV: "1024", config.TUNE_ENV: "Force",
           config.HOSTMEM_ENV: "off", config.AGREEMENT_TIMEOUT_ENV: "30", config.TUNE_TIMEOUT_ENV: "90"}
    assert config.settings_from_environment(env) == config.OverlaySettings(
        mode="off", max_bytes=1024, tune="force", hostmem="off", agreement_timeout_s=30.0, tune_timeout_s=90.0)
    assert config.settings_from_environment({config.MAX_BYTES_ENV: "auto"}).max_bytes is None
    with pytest.raises(config.SettingError, match=r"one of auto, off \(auto: use pinned host memory"):
        config.settings_from_environment({config.HOSTMEM_ENV: "sometimes"})


def test_the_flags_lay_over_the_environment():
    parsed = _parser().parse_args(["--sm120-allreduce-tune", " Force", "--sm120-allreduce", "on"])
    assert parsed.sm120_allreduce_tune == "force"  # argparse parsed it, once (SettingAction)
    assert _parser().parse_args([]).sm120_allreduce_tune is None
    env = config.settings_from_environment({config.TUNE_ENV: "off", config.MAX_BYTES_ENV: "4096"})
    assert config.with_flags(env, parsed) == config.OverlaySettings(mode="on", max_bytes=4096, tune="force")
    assert config.with_flags(env, _parser().parse_args([])) == env


def test_a_process_reads_the_settings_stored_on_its_server_args_else_its_environment():
    class Args:
        pass

    stored = config.OverlaySettings(mode="on", max_bytes=2048)
    args = Args()
    setattr(args, config.SETTINGS_ATTR, stored)
    env = {config.MODE_ENV: "off", config.MAX_BYTES_ENV: "4096"}
    assert config.settings_of(args, env) is stored  # not parsed again
    assert config.settings_of(Args(), env) == config.OverlaySettings("off", 4096)  # rebuilt from its fields
    assert config.settings_of(None, {}) == config.OverlaySettings("auto", None)


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


def test_explicit_bound_wins_over_the_derived_cap():
    class Args:
        cuda_graph_max_bs = 8

    bound = config.resolve_max_bytes(64 << 20, Args(), 7168, 2)
    assert bound.max_bytes == 64 << 20
    derived = config.resolve_max_bytes(None, Args(), 7168, 2)
    assert derived.max_bytes == 8 * 7168 * 2


def test_an_explicit_bound_of_part_of_a_vector_is_rounded_down_and_said():
    """A bound the workspace cannot be sized by used to disable the backend; the kernels' own limits say what a
    workspace's size is a multiple of."""
    from sgl_kernel_sm120.policy import ELEMENT_BYTES, kernel_limits

    grain = kernel_limits().elems_per_pack
    assert config.VECTOR_BYTES == grain * ELEMENT_BYTES
    bound = config.resolve_max_bytes(config.parse_max_bytes(config.MAX_BYTES_ENV, "1000"), None, 7168, 2)
    assert bound.max_bytes == 992 and (bound.max_bytes // ELEMENT_BYTES) % grain == 0
    assert bound.explanation.endswith("rounded down from 1000 B to whole 16-byte vectors"), bound.explanation
    assert "rounded" not in config.resolve_max_bytes(1024, None, 7168, 2).explanation
    assert config.resolve_max_bytes(config.MIN_MAX_BYTES + 15, None, 7168, 2).max_bytes == config.MIN_MAX_BYTES


def test_bad_environment_stops_the_cli_launch_in_one_line_before_sglang_resolves_anything(monkeypatch, capsys):
    """0.5.23's from_cli_args only builds the record (resolution comes later); 0.5.13.post1's __post_init__ seam
    parses the environment before SGLang's own checks (next test). Either way the launch ends in one line."""
    from types import SimpleNamespace

    from sglang_sm120.hooks import server_args as hooks_server_args

    records = []

    def original_from_cli_args(cls, args):
        records.append(SimpleNamespace())
        return records[-1]

    from_cli_args = hooks_server_args.wrap_from_cli_args(classmethod(original_from_cli_args)).__func__
    monkeypatch.setenv(config.MAX_BYTES_ENV, "-5")
    with pytest.raises(SystemExit) as caught:
        from_cli_args(object, object())
    assert caught.value.code == 2 and not hasattr(records[0], config.SETTINGS_ATTR)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sglang_sm120: SGLANG_SM120_ALLREDUCE_MAX_BYTES='-5': a byte count from 16"), err
    assert len(err.splitlines()) == 1, err


def test_bad_environment_raises_before_sglang_post_init_runs(monkeypatch):
    from sglang_sm120.hooks import server_args as hooks_server_args

    calls = []
    post_init = hooks_server_args.wrap_post_init(lambda self: calls.append(self))
    monkeypatch.setenv(config.MODE_ENV, "sometimes")
    with pytest.raises(config.SettingError, match="SGLANG_SM120_ALLREDUCE='sometimes'"):
        post_init(object())
    assert calls == []


def test_kernel_timeout_follows_dist_timeout_unless_the_kernel_variable_is_set():
    class Args:
        dist_timeout = 1800

    assert config.kernel_timeout_s(Args(), {}) == 1800.0
    for spelling in ("SGL_SM120_AR_TIMEOUT_S", "SGLANG_SM120_AR_TIMEOUT_S"):  # the kernel package reads it itself
        assert config.kernel_timeout_s(Args(), {spelling: "30"}) is None
    assert config.kernel_timeout_s(None, {}) is None

    class NoTimeout:
        dist_timeout = None

    assert config.kernel_timeout_s(NoTimeout(), {}) is None


@pytest.mark.parametrize("spelling", ["SGLANG_SM120_ALLREDUCE", "SGL_SM120_ALLREDUCE"])
def test_every_setting_is_read_under_both_spellings(spelling):
    assert config.settings_from_environment({spelling: "off"}).mode == "off"
    assert config.settings_from_environment({"SGLANG_SM120_ALLREDUCE": "on", "SGL_SM120_ALLREDUCE": "on"}).mode == "on"


def test_one_setting_at_two_values_is_an_error_naming_both():
    with pytest.raises(config.SettingError, match="SGL_SM120_ALLREDUCE='off' and SGLANG_SM120_ALLREDUCE='on'"):
        config.settings_from_environment({"SGLANG_SM120_ALLREDUCE": "on", "SGL_SM120_ALLREDUCE": "off"})


@pytest.mark.parametrize("name, value", [("SGL_SM120_AR_TIMEOUT_S", "-5"), ("SGLANG_SM120_AR_WARN_S", "soon"),
                                         ("SGL_SM120_FUSED_CLUSTERS", "maybe")])
def test_a_bad_kernel_switch_stops_the_launch_with_the_overlays_settings(name, value):
    """Read with the overlay's settings, when SGLang makes its ServerArgs: one line, before any rank starts (not a
    DISABLED line at pre-capture)."""
    with pytest.raises(config.SettingError, match=name.replace("SGLANG_", "SGL_").replace("SGL_", "SGL(ANG)?_")):
        config.settings_from_environment({name: value})
