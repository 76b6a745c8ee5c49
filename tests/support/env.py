"""Setting a kernel or overlay switch for a child process under both of its spellings."""

from __future__ import annotations

from sgl_kernel_sm120.settings import spellings


def spelled_out(name: str, value: str) -> dict[str, str]:
    """The setting at `value` under both spellings, so SGLang's copy of one over the other changes nothing."""
    return dict.fromkeys(spellings(name), value)
