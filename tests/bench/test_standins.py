"""Stand-ins for sgl_kernel / flashinfer (used on the GPU machine, where those wheels are not carried).
Each check runs in a fresh interpreter so the stand-ins never leak into other tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "python"), REPO, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=600)


def test_standin_behaviour():
    done = run_python(
        """
        import importlib.util, inspect
        from benchmarks.harness import standins
        real = {r for r in standins.STANDIN_ROOTS if importlib.util.find_spec(r) is not None}
        roots = standins.install()
        assert set(roots) == set(standins.STANDIN_ROOTS) - real, roots
        assert standins.install() == roots  # idempotent
        if "sgl_kernel" in roots:
            import sgl_kernel
            from sgl_kernel import fused_add_rmsnorm
            import sgl_kernel.flash_attn as fa
            from sgl_kernel.flash_attn import flash_attn_varlen_func
            try:
                fused_add_rmsnorm(1, 2)
                raise SystemExit("stand-in did not raise")
            except standins.StandInCalled as exc:
                assert "sgl_kernel" in str(exc)
            try:
                sgl_kernel.ops.deeper.still_deeper()
                raise SystemExit("nested stand-in did not raise")
            except standins.StandInCalled:
                pass
            assert not hasattr(sgl_kernel, "__version__")
            assert not hasattr(fused_add_rmsnorm, "__wrapped__")
            inspect.signature(fused_add_rmsnorm)
            class Sub(sgl_kernel.SomeBase):  # class definitions over stand-ins work
                pass
        if "flashinfer" in roots:
            import flashinfer
            import flashinfer.norm
            for name in ("flashinfer.comm", "flashinfer.comm.trtllm_ar"):
                try:
                    __import__(name)
                    raise SystemExit(name + " was found")
                except ImportError:
                    pass
            try:
                from flashinfer import comm
                raise SystemExit("from flashinfer import comm worked")
            except ImportError:
                pass
            assert importlib.util.find_spec("flashinfer.comm") is None
        standins.uninstall()
        assert standins.installed_roots() == ()
        print("OK", sorted(roots))
        """
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout


def test_sglang_layers_import_with_standins():
    pytest.importorskip("sglang")
    done = run_python(
        """
        from benchmarks.harness import standins
        standins.install()
        import importlib
        import sglang_sm120
        from sglang_sm120 import seams
        from sglang_sm120.seams import base
        sglang_sm120.activate()
        for module in sorted({seam.module_name for seam in seams.load_table().SEAMS}):
            importlib.import_module(module)
        assert base.pending_targets() == [], base.pending_targets()
        print("OK")
        """
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
