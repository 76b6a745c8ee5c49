"""The package's errors say what happened and what is left usable (sgl_kernel_sm120/errors.py)."""

from __future__ import annotations

import sgl_kernel_sm120 as k


def test_a_timeout_says_what_is_left_usable():
    trapped = k.IpcAllReduceTimeoutError(0, 3, "one-shot", 7, 1.5)
    assert "CUDA context of this process is no longer usable" in str(trapped) and trapped.context_lost
    exited = k.IpcAllReduceTimeoutError(0, 3, "one-shot", 7, 1.5, context_lost=False)
    assert "workspace is unusable" in str(exited) and "the CUDA context is not" in str(exited)
    assert "rank 3" in str(exited) and "call #7" in str(exited)


def test_a_probe_error_names_the_pairs_and_the_likely_causes():
    err = k.IpcAllReduceProbeError([(1, 0, "write never arrived")])
    assert isinstance(err, k.IpcAllReduceError) and err.pairs == [(1, 0, "write never arrived")]
    assert "rank 1 -> rank 0: write never arrived" in str(err) and "ACS" in str(err) and "iommu=pt" in str(err)
    many = k.IpcAllReduceProbeError([(0, r, "x") for r in range(1, 20)])
    assert "(+3 more)" in str(many)
