"""scripts/device_lib.py: a library carried to a device call is used only when it was built from these kernel
sources for this Python, torch and the archs asked for, and loads from where it was put; otherwise nothing is
left in place and gpu_suite compiles."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("device_lib", ROOT / "scripts" / "device_lib.py")
device_lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_lib)

SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def _tree(tmp_path: Path) -> Path:
    """A checkout with the files the digest covers and the kernel package's Python."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "csrc", root / "csrc")
    shutil.copy2(ROOT / "setup.py", root / "setup.py")
    shutil.copytree(ROOT / "sgl_kernel_sm120", root / "sgl_kernel_sm120",
                    ignore=shutil.ignore_patterns("_C_torch*", "__pycache__"))
    return root


def test_the_digest_changes_with_any_kernel_source_and_only_with_them(tmp_path):
    root = _tree(tmp_path)
    before = device_lib.sources_digest(root)
    assert before == device_lib.sources_digest(ROOT)
    (root / "sgl_kernel_sm120" / "policy.py").write_text("# not compiled\n")
    assert device_lib.sources_digest(root) == before
    header = sorted((root / "csrc").rglob("*.cuh"))[0]
    header.write_text(header.read_text() + "\n")
    assert device_lib.sources_digest(root) != before


def test_each_difference_is_named_and_a_match_is_none():
    record = {"sources": "abc", "library": "_C_torch2_11_0_cuda13_0" + SUFFIX, "torch": "2.11.0+cu130",
              "archs": ["9.0a"]}
    fine = {"digest": "abc", "ext_suffix": SUFFIX, "torch_version": "2.11.0+cu130", "archs": ["9.0a"]}
    assert device_lib.mismatch(record, **fine) is None
    assert "other kernel sources" in device_lib.mismatch(record, **{**fine, "digest": "abd"})
    assert "another Python" in device_lib.mismatch(record, **{**fine, "ext_suffix": ".cpython-399-x.so"})
    assert "torch 2.11.0+cu130, this is 2.14.1" in device_lib.mismatch(record, **{**fine, "torch_version": "2.14.1"})
    assert "not for ['12.0a']" in device_lib.mismatch(record, **{**fine, "archs": ["9.0a", "12.0a"]})
    assert device_lib.requested_archs("9.0a;12.0a") == device_lib.requested_archs("9.0a 12.0a") == ["9.0a", "12.0a"]


def _carry(root: Path, library: Path, **record_changes) -> None:
    import torch

    carry = root / ".device-lib"
    carry.mkdir()
    shutil.copy2(library, carry / library.name)
    record = {"sources": device_lib.sources_digest(root), "library": library.name, "torch": torch.__version__,
              "archs": ["9.0a", "12.0a"], **record_changes}
    (carry / "record.json").write_text(json.dumps(record))


def _built_library() -> Path:
    built = os.environ.get("SGL_SM120_EXT_LIBRARY")
    if not built:
        pytest.skip("no built library named by SGL_SM120_EXT_LIBRARY (make pytest sets it)")
    return Path(built)


def test_a_matching_library_is_put_in_place_and_loads_from_there(tmp_path, capsys):
    root = _tree(tmp_path)
    library = _built_library()
    _carry(root, library)
    assert device_lib.install("9.0a", root) == 0, capsys.readouterr().out
    assert (root / "sgl_kernel_sm120" / library.name).exists()
    assert "the carried library is in place" in capsys.readouterr().out


def test_a_library_of_other_sources_is_not_put_in_place(tmp_path, capsys):
    root = _tree(tmp_path)
    _carry(root, _built_library(), sources="0123456789abcdef")
    assert device_lib.install("9.0a", root) == 1
    assert "other kernel sources" in capsys.readouterr().out
    assert not list((root / "sgl_kernel_sm120").glob("_C_torch*"))


def test_a_library_that_does_not_load_is_taken_away_again(tmp_path, capsys):
    root = _tree(tmp_path)
    broken = tmp_path / _built_library().name
    broken.write_bytes(b"not an ELF file")
    _carry(root, broken)
    assert device_lib.install("9.0a", root) == 1
    assert "does not load here" in capsys.readouterr().out
    assert not list((root / "sgl_kernel_sm120").glob("_C_torch*"))


def test_without_a_carried_library_the_suite_builds(tmp_path, capsys):
    assert device_lib.install("9.0a", _tree(tmp_path)) == 1
    assert "building here" in capsys.readouterr().out


def _carry_negative(root: Path, **record_changes) -> None:
    import torch

    carry = root / ".device-lib-negative"
    for name in ("sgl_sm120_sgl_sm120_debug_no_clear", "sgl_sm120_sgl_sm120_debug_single_buffer"):
        (carry / name).mkdir(parents=True)
        (carry / name / f"{name}.so").write_bytes(b"a broken build")
    record = {"sources": device_lib.sources_digest(root), "library": "_C_torch" + SUFFIX, "torch": torch.__version__,
              "archs": ["9.0a"], **record_changes}
    (carry / "record.json").write_text(json.dumps(record))


def test_matching_negative_control_builds_go_where_the_tests_look_for_them(tmp_path, capsys):
    root, into = _tree(tmp_path), tmp_path / "negative-builds"
    _carry_negative(root)
    assert device_lib.install_negative("9.0a", into, root) == 0, capsys.readouterr().out
    found = sorted(p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_file())
    assert found == ["sgl_sm120_sgl_sm120_debug_no_clear/sgl_sm120_sgl_sm120_debug_no_clear.so",
                     "sgl_sm120_sgl_sm120_debug_single_buffer/sgl_sm120_sgl_sm120_debug_single_buffer.so"]


@pytest.mark.parametrize(("change", "said"), [({"sources": "0123456789abcdef"}, "other kernel sources"),
                                              ({"torch": "2.0.0"}, "built against torch 2.0.0")])
def test_negative_control_builds_of_other_sources_or_torch_are_not_used(tmp_path, capsys, change, said):
    root, into = _tree(tmp_path), tmp_path / "negative-builds"
    _carry_negative(root, **change)
    assert device_lib.install_negative("9.0a", into, root) == 1
    assert said in capsys.readouterr().out
    assert not into.exists()


def test_without_carried_negative_control_builds_they_are_compiled_there(tmp_path, capsys):
    assert device_lib.install_negative("9.0a", tmp_path / "negative-builds", _tree(tmp_path)) == 1
    assert "compiled here" in capsys.readouterr().out
