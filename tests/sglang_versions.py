"""Which SGLang the suite runs against. CI runs the CPU suite once per supported SGLang, each in its own
environment; tests written for one version skip, with the reason, under the other."""

from __future__ import annotations

import importlib.metadata

import pytest


def installed_sglang() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def requires_sglang(version: str) -> pytest.MarkDecorator:
    """Mark a test (or, as `pytestmark`, a module) as written for exactly this SGLang release."""
    have = installed_sglang()
    return pytest.mark.skipif(
        have != version,
        reason=f"written for sglang {version}; installed: {have or 'none'}",
    )
