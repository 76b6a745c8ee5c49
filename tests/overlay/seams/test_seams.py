"""The overlay applied to the real pinned SGLang package (no GPU): activation, every seam patched and
restored, version refusal, plugin entry point, server arguments and their journey to scheduler processes."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import pickle
import re
import sys

import pytest

pytest.importorskip("sglang")

import sglang_sm120  # noqa: E402
from sglang_sm120 import plugin, seams  # noqa: E402
from sglang_sm120.core import config  # noqa: E402
from sglang_sm120.seams import base  # noqa: E402
from tests.sglang_versions import requires_sglang  # noqa: E402


def applied_targets() -> list[str]:
    """The targets of the seams applied now, in the order they were applied."""
    with base._lock:
        return [entry.seam.target for entry in base._applied]


# Tests of 0.5.13.post1's own seams (the rest of this file holds for every supported SGLang).
ONLY_0513 = requires_sglang("0.5.13.post1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def current(target):
    return base._raw(*base.Seam(target, None).locate())


def test_every_seam_patched_and_restored():
    table = seams.load_table()
    originals = {seam.target: current(seam.target) for seam in table.SEAMS}
    sglang_sm120.activate()
    try:
        assert plugin.is_active()
        assert sorted(applied_targets()) == sorted(originals)
        for target, original in originals.items():
            now = current(target)
            assert now is not original, target
            assert base.is_ours(now), target
            assert getattr(base._func(now), "__wrapped__", None) is base._func(original), target
    finally:
        sglang_sm120.deactivate()
    assert not plugin.is_active()
    for target, original in originals.items():
        assert current(target) is original, target


def test_activation_is_idempotent(overlay):
    first = {target: current(target) for target in applied_targets()}
    sglang_sm120.activate()
    plugin.activate()
    assert {target: current(target) for target in applied_targets()} == first
    # even if our bookkeeping were lost, a marked attribute is never wrapped twice
    assert base.apply(seams.load_table().SEAMS) == 0


def test_unknown_version_is_refused_naming_supported_ones(monkeypatch):
    monkeypatch.setattr(seams, "sglang_version", lambda: "0.5.99")
    with pytest.raises(seams.UnsupportedSGLangVersion, match=r"0\.5\.99.*0\.5\.13\.post1"):
        sglang_sm120.activate()
    assert not plugin.is_active()
    assert applied_targets() == []


def test_unknown_version_with_our_flag_on_the_command_line_stops_in_one_line(monkeypatch, capsys):
    """Before SGLang's parser would say `unrecognized arguments: --sm120-allreduce auto`."""
    monkeypatch.setattr(seams, "sglang_version", lambda: "0.5.99")
    monkeypatch.setattr(sys, "argv", ["launch_server", "--model-path", "m", "--sm120-allreduce", "auto"])
    with pytest.raises(SystemExit) as caught:
        sglang_sm120.activate()
    assert caught.value.code == 2 and not plugin.is_active()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: sglang_sm120: sglang_sm120 has no seam table for sglang 0.5.99; supported:"), err
    assert "names --sm120-allreduce, which only the overlay adds" in err and "drop it" in err, err
    plugin.refuse_our_flags(RuntimeError("x"), ["prog", "--model-path", "m"])  # no flag of ours: nothing to say


@ONLY_0513
def test_the_pinned_version_has_a_table():
    assert seams.sglang_version() == "0.5.13.post1"
    assert seams.load_table().SGLANG_VERSION == "0.5.13.post1"


def test_failed_seam_rolls_back_the_others(monkeypatch):
    table = seams.load_table()
    broken = list(table.SEAMS) + [base.Seam("sglang.srt.server_args:ServerArgs.no_such_attribute", lambda o: o)]
    originals = {seam.target: current(seam.target) for seam in table.SEAMS}
    with pytest.raises(AttributeError, match="no_such_attribute"):
        base.apply(broken)
    for target, original in originals.items():
        assert current(target) is original


def test_entry_point_is_discoverable_when_installed():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "sm120_allreduce"]
    if not eps:
        pytest.skip("sglang-sm120 is not installed (pip install -e .): entry point not registered")
    assert eps[0].value == "sglang_sm120.plugin:activate"
    assert eps[0].load() is plugin.activate


def test_sglang_plugin_loader_runs_activate(monkeypatch, clean_env):
    """SGLang's own loader, fed our entry point, activates the overlay."""
    import sglang.srt.plugins as plugins

    ep = importlib.metadata.EntryPoint("sm120_allreduce", "sglang_sm120.plugin:activate", "sglang.srt.plugins")
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep] if group == plugins.GENERAL_PLUGINS_GROUP else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    try:
        plugins.load_plugins()
        assert plugin.is_active()
    finally:
        sglang_sm120.deactivate()


def parser_with_flags():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_flags_in_help(overlay):
    text = parser_with_flags().format_help()
    assert "--sm120-allreduce {auto,on,off}" in text
    assert "--sm120-allreduce-max-bytes N" in text
    assert "--sm120-allreduce-tune {auto,off,force}" in text
    assert config.MODE_ENV in text and config.MAX_BYTES_ENV in text and config.TUNE_ENV in text


def settings(server_args):
    """The settings object stored on the record (never re-parsed)."""
    stored = getattr(server_args, config.SETTINGS_ATTR)
    assert isinstance(stored, config.OverlaySettings)
    return stored


def test_flags_reach_a_pickled_server_args_and_nothing_is_written_to_the_environment(overlay, clean_env):
    from sglang.srt.server_args import ServerArgs

    args = parser_with_flags().parse_args(
        ["--model-path", "dummy", "--sm120-allreduce", "on", "--sm120-allreduce-max-bytes", "65536",
         "--sm120-allreduce-tune", "off"]
    )
    before = dict(os.environ)
    server_args = ServerArgs.from_cli_args(args)
    assert settings(server_args) == config.OverlaySettings("on", 65536, "off")
    clone = pickle.loads(pickle.dumps(server_args))  # what every scheduler process receives
    assert config.settings_of(clone, {}) == config.OverlaySettings("on", 65536, "off")
    assert dict(os.environ) == before


@ONLY_0513
def test_flag_defaults(overlay, clean_env):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs.from_cli_args(parser_with_flags().parse_args(["--model-path", "dummy"]))
    assert settings(server_args) == config.OverlaySettings()
    assert config.MODE_ENV not in os.environ and config.TUNE_ENV not in os.environ


def test_bad_flag_values_are_rejected(overlay, capsys):
    with pytest.raises(SystemExit):
        parser_with_flags().parse_args(["--model-path", "dummy", "--sm120-allreduce", "maybe"])
    with pytest.raises(SystemExit):
        parser_with_flags().parse_args(["--model-path", "dummy", "--sm120-allreduce-max-bytes", "-5"])


def test_a_bad_variable_ends_the_command_line_launch_in_one_line(overlay, clean_env, monkeypatch, capsys):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.TUNE_ENV, "always")
    with pytest.raises(SystemExit) as ended:
        ServerArgs.from_cli_args(parser_with_flags().parse_args(["--model-path", "dummy"]))
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: sglang_sm120: {config.TUNE_ENV}='always'")


@ONLY_0513
def test_env_equivalents_for_the_engine_api(overlay, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.MODE_ENV, "off")
    monkeypatch.setenv(config.MAX_BYTES_ENV, "4096")
    monkeypatch.setenv(config.TUNE_ENV, "force")
    server_args = ServerArgs(model_path="dummy")  # what sglang.Engine(**kwargs) builds
    assert settings(server_args) == config.OverlaySettings("off", 4096, "force")
    clone = pickle.loads(pickle.dumps(server_args))
    assert config.settings_of(clone, {}) == config.OverlaySettings("off", 4096, "force")


@ONLY_0513
def test_bad_env_value_fails_at_server_args_construction(overlay, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match=config.MODE_ENV):
        ServerArgs(model_path="dummy")


def test_cli_beats_env(overlay, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.MODE_ENV, "off")
    monkeypatch.setenv(config.MAX_BYTES_ENV, "4096")
    args = parser_with_flags().parse_args(["--model-path", "dummy", "--sm120-allreduce", "on"])
    assert settings(ServerArgs.from_cli_args(args)) == config.OverlaySettings("on", 4096)


def test_flashinfer_fusion_kept_off_on_sm12x(overlay):
    from types import SimpleNamespace

    from sglang_sm120.hooks.server_args import keep_flashinfer_fusion_off_on_sm120

    def record(mode):
        return SimpleNamespace(**{config.SETTINGS_ATTR: config.OverlaySettings(mode)},
                               enable_flashinfer_allreduce_fusion=True)

    args = record("auto")
    assert keep_flashinfer_fusion_off_on_sm120(args, capability=(12, 0))
    assert args.enable_flashinfer_allreduce_fusion is False
    for capability, mode in (((9, 0), "auto"), ((10, 0), "on"), ((12, 0), "off")):
        args = record(mode)
        assert not keep_flashinfer_fusion_off_on_sm120(args, capability=capability)
        assert args.enable_flashinfer_allreduce_fusion is True


def test_seams_of_modules_not_yet_imported_apply_on_import(tmp_path, monkeypatch):
    package = tmp_path / "sm120_seam_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "late.py").write_text("def answer():\n    return 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def plus_one(original):
        def answer():
            return original() + 1

        return answer

    seam = base.Seam("sm120_seam_probe_pkg.late:answer", plus_one)
    try:
        assert base.apply([seam]) == 0
        assert "sm120_seam_probe_pkg.late:answer" in base.pending_targets()
        import sm120_seam_probe_pkg.late as late

        assert late.answer() == 42
        assert late.__loader__.__class__.__name__ == "SourceFileLoader"
        assert base.pending_targets() == []
    finally:
        base.restore_all()
    assert late.answer() == 41


# ---------------------------------------------------------------------------------------------------------
# every target resolves at activation, or activation fails naming it (both tables, whichever SGLang is here)


def table_modules():
    import importlib

    return {version: importlib.import_module(name) for version, name in seams.SEAM_TABLES.items()}


@pytest.mark.parametrize("version", sorted(seams.SEAM_TABLES))
@pytest.mark.parametrize("bad_target,named", [
    ("sglang.srt.no_such_module:anything", "module sglang.srt.no_such_module not found"),
    ("sglang.srt.server_args:ServerArgs.no_such_attribute", "has no attribute 'no_such_attribute'"),
    ("sglang.srt.layers.no_such_pkg.deeper:thing", "module sglang.srt.layers.no_such_pkg.deeper not found"),
])
def test_unresolved_target_fails_activation_naming_it(monkeypatch, version, bad_target, named):
    import sglang.srt.server_args  # noqa: F401  (imported: its attributes are checked, not only located)

    table = table_modules()[version]
    fake = base.Seam(bad_target, lambda original: original)
    monkeypatch.setattr(table, "SEAMS", list(table.SEAMS) + [fake])
    with pytest.raises(base.UnresolvedSeamTarget, match=re.escape(named)) as caught:
        if version == seams.sglang_version():
            sglang_sm120.activate()
        else:  # the other release's table also names its own targets here; ours must be among them
            base.apply(table.SEAMS)
    assert any(problem.startswith(bad_target) for problem in caught.value.problems)
    assert not plugin.is_active()
    assert applied_targets() == [] and base.pending_targets() == []


@pytest.mark.parametrize("version", sorted(seams.SEAM_TABLES))
def test_a_missing_read_fails_activation_naming_it(monkeypatch, version):
    table = table_modules()[version]
    monkeypatch.setattr(table, "READS", list(getattr(table, "READS", [])) + ["sglang.srt.no_such_module:flag"])
    with pytest.raises(base.UnresolvedSeamTarget, match="sglang.srt.no_such_module:flag"):
        seams.load_table(version) if version == seams.sglang_version() else base.check_resolvable(table.READS)


def test_the_other_versions_table_does_not_resolve_here():
    """What the check is for: a table applied to the wrong SGLang fails at activation, naming its targets."""
    installed = seams.sglang_version()
    others = {v: t for v, t in table_modules().items() if v != installed}
    assert others, "expected a second table"
    for version, table in others.items():
        with pytest.raises(base.UnresolvedSeamTarget) as caught:
            base.check_resolvable([seam.target for seam in table.SEAMS] + list(getattr(table, "READS", [])))
        assert caught.value.problems, version
    table = seams.load_table()
    base.check_resolvable([seam.target for seam in table.SEAMS] + list(getattr(table, "READS", [])))


def test_locating_a_module_imports_nothing(tmp_path, monkeypatch):
    package = tmp_path / "sm120_locate_probe"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported the parent')\n")
    (package / "sub" / "__init__.py").write_text("raise RuntimeError('imported the package')\n")
    (package / "sub" / "leaf.py").write_text("raise RuntimeError('imported the leaf')\n")
    (tmp_path / "sm120_ns_probe" / "inner").mkdir(parents=True)  # namespace portions, no __init__.py
    (tmp_path / "sm120_ns_probe" / "inner" / "leaf.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base.check_resolvable(["sm120_locate_probe.sub.leaf:x", "sm120_ns_probe.inner.leaf:x"])
    assert not any(name.startswith(("sm120_locate_probe", "sm120_ns_probe")) for name in sys.modules)
    with pytest.raises(base.UnresolvedSeamTarget, match="sm120_ns_probe.inner.missing"):
        base.check_resolvable(["sm120_ns_probe.inner.missing:x"])


def test_upstream_pcie_ipc_is_not_requested_where_sglang_has_none(monkeypatch):
    from sglang_sm120.hooks import upstream_pcie

    monkeypatch.setenv(upstream_pcie.ENV, "1")
    has_one = upstream_pcie.find_module_spec(upstream_pcie.UPSTREAM_MODULE) is not None
    assert upstream_pcie.upstream_pcie_ipc_requested() is has_one


@pytest.mark.parametrize("version", sorted(seams.SEAM_TABLES))
def test_the_seam_ledger_in_the_docs_names_every_seam_of_every_release(version):
    """docs/overlay.md is the ledger a maintainer reads: each seam's target as `module:Owner.attribute` without the
    `sglang.srt.` prefix, in that release's table."""
    text = open(os.path.join(REPO, "docs", "overlay.md"), encoding="utf-8").read()
    section = text.split(f"### SGLang {version}", 1)[1].split("\n### ", 1)[0]
    table = importlib.import_module(seams.SEAM_TABLES[version])
    missing = [s.target for s in table.SEAMS if f"`{s.target.removeprefix('sglang.srt.')}`" not in section]
    assert not missing, f"docs/overlay.md, section SGLang {version}, does not name {missing}"
