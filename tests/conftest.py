"""Shared pytest setup.

GPU tests carry the `gpu` marker and are selected with `pytest -m gpu` (CI runs `pytest -m "not gpu"`).
A test that needs N GPUs says so in either way; it is skipped, with the reason, when fewer are visible:

    @pytest.mark.gpu(2)                 # marker with a count (default 1)
    def test_allreduce_two_ranks(): ...

    @pytest.mark.gpu
    def test_something(require_gpus):   # fixture returning a callable
        require_gpus(2)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Running from a checkout without `pip install -e .`: make both packages importable from source.
for _pkg, _parent in (("sgl_kernel_sm120", REPO_ROOT), ("sglang_sm120", os.path.join(REPO_ROOT, "python"))):
    if importlib.util.find_spec(_pkg) is None and _parent not in sys.path:
        sys.path.insert(0, _parent)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu(n=1): needs n CUDA GPUs; select with `pytest -m gpu`, skipped when fewer are visible",
    )


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 without a CUDA build of torch or a driver)."""
    try:
        import torch
    except ImportError:
        return 0
    if torch.version.cuda is None:
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:
        return 0


def _skip_reason(n: int) -> str | None:
    have = gpu_count()
    if have >= n:
        return None
    return f"needs {n} CUDA GPU(s), {have} visible"


def require_gpus(n: int) -> None:
    """Skip the calling test unless at least `n` CUDA GPUs are visible."""
    reason = _skip_reason(n)
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path_factory):
    """Every test gets its own $SGLANG_SM120_CACHE: no test reads or writes the user's routing tables or
    cluster-check verdicts."""
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path_factory.mktemp("sm120-cache")))


@pytest.fixture(autouse=True)
def no_fused_boundary_state():
    """The fused boundary's module state (the backend served, a claim, the route memo) does not outlive a test:
    a test that builds or serves a backend leaves nothing for the next one."""
    yield
    fusion = sys.modules.get("sglang_sm120.hooks.fusion")
    if fusion is not None:
        fusion.serve(None)


@pytest.fixture
def clean_env(monkeypatch):
    """The overlay's variables under both spellings (and SGLang's PCIe-IPC switch) unset for the test.
    setenv-then-delenv records "unset" as the value to restore, so values the code under test writes into
    os.environ (SGLang's own resolution exports some of its settings) are removed after the test."""
    from sgl_kernel_sm120.settings import spellings
    from sglang_sm120.core import config

    names = [spelled for _, name, _ in config.ENVIRONMENT for spelled in spellings(name)]
    names.append("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE")
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def overlay(clean_env):
    """The overlay activated on the installed SGLang for the test, restored after it."""
    import sglang_sm120

    sglang_sm120.activate()
    yield
    sglang_sm120.deactivate()


@pytest.fixture(name="require_gpus")
def require_gpus_fixture():
    """`require_gpus(n)` inside a test: skip it unless n GPUs are visible."""
    return require_gpus


@pytest.fixture
def gpus():
    """Number of visible CUDA GPUs."""
    return gpu_count()


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    n = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    reason = _skip_reason(int(n))
    # SGLang-level GPU tests whose harness has a CPU dry run (gloo, stand-in kernels) run without GPUs there.
    if reason and not (os.environ.get("SGL_SM120_TEST_DRY_RUN") == "1" and getattr(item.module, "DRY_RUN_OK", False)):
        pytest.skip(reason)
