"""benchmarks/harness/triton_add_rmsnorm.py under Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess so the
setting cannot leak into other tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch
    from benchmarks.harness import triton_add_rmsnorm as k
    from benchmarks.harness.norms import reference_add_rmsnorm

    g = torch.Generator().manual_seed(0)
    for rows, hidden in ((1, 7168), (3, 1000), (4, 1024)):
        x = torch.randint(-4, 5, (rows, hidden), generator=g).to(torch.bfloat16)
        r = torch.randint(-4, 5, (rows, hidden), generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
        ref_n, ref_r = reference_add_rmsnorm(x, r, w, 1e-6)
        # out of place: inputs untouched
        x_before, r_before = x.clone(), r.clone()
        n, rr = k.add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(x, x_before) and torch.equal(r, r_before), "add_rmsnorm wrote into its inputs"
        assert torch.equal(rr, ref_r), "residual_out"
        assert torch.allclose(n.float(), ref_n.float(), rtol=1 / 128, atol=1 / 128), (n - ref_n).abs().max()
        # in place, like sgl_kernel.fused_add_rmsnorm
        xi, ri = x.clone(), r.clone()
        k.fused_add_rmsnorm(xi, ri, w, 1e-6)
        assert torch.equal(ri, ref_r) and torch.equal(xi, n)
        # plain rmsnorm
        p = k.rmsnorm(x, w, 1e-6)
        ref_p = reference_add_rmsnorm(x, None, w, 1e-6)[0]
        assert torch.allclose(p.float(), ref_p.float(), rtol=1 / 128, atol=1 / 128)
    print("OK")
    """
)


def test_triton_add_rmsnorm_matches_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "python"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
