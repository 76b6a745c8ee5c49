"""A real `python -m sglang.launch_server` of the installed release with the overlay's settings in its environment:
SGLang copies SGL_SM120_X over SGLANG_SM120_X when it is imported, before the plugin reads either, so two values
of one setting must still stop the launch in one line naming both, and one spelling alone must still launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _launch(tmp_path, **variables: str) -> subprocess.CompletedProcess:
    pytest.importorskip("sglang")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGL_SM120_ALLREDUCE", "SGLANG_SM120_ALLREDUCE"))}
    env.update(variables, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "python")]))
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "no-model"),
                           "--device", "cpu"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_two_values_under_the_two_spellings_stop_the_launch_in_one_line_naming_both(tmp_path):
    done = _launch(tmp_path, SGL_SM120_ALLREDUCE="off", SGLANG_SM120_ALLREDUCE="on")
    ours = [line for line in done.stderr.splitlines() if "sglang_sm120" in line]
    assert done.returncode == 2 and ours == [
        "error: sglang_sm120: SGL_SM120_ALLREDUCE='off' and SGLANG_SM120_ALLREDUCE='on' are one setting at two "
        "values: unset one of them"], done.stderr[-3000:]


def test_one_spelling_alone_passes_the_settings_after_sglangs_copy(tmp_path):
    done = _launch(tmp_path, SGL_SM120_ALLREDUCE="off")
    assert done.returncode not in (0, 2), done.stderr[-3000:]  # it ends at the missing model, past the settings
    assert "error: sglang_sm120" not in done.stderr and "no-model" in done.stderr, done.stderr[-3000:]
