"""Names of the compiled extension, one per (torch, CUDA) pair it was built against.

torch extensions have no stable ABI across torch releases, so environments sharing one checkout keep their own
build side by side, and the loader says "built for torch X, this is torch Y" instead of a linker error. Standard
library only: setup.py loads this file by path.
"""

from __future__ import annotations

import re

PREFIX = "_C_torch"


def extension_tag(torch_version: str, cuda_version: str | None) -> str:
    """'2.14.1+cu130', '13.0' -> 'torch2_14_1_cuda13_0'. The local version label (+cu130) is dropped: the CUDA
    version that torch reports says the same and is what the library links against."""
    base = torch_version.split("+", 1)[0]
    text = f"torch{base}_cuda{cuda_version or 'none'}"
    return re.sub(r"[^0-9A-Za-z]+", "_", text)


def extension_module(torch_version: str, cuda_version: str | None) -> str:
    return "_C_" + extension_tag(torch_version, cuda_version)


def describe_tag(module_name: str) -> str:
    """'_C_torch2_14_1_cuda13_0' -> 'torch 2.14.1, CUDA 13.0' (best effort, for messages)."""
    match = re.fullmatch(r"_C_torch([0-9_a-z]+?)_cuda([0-9_]+|none)", module_name)
    if not match:
        return module_name
    torch_part, cuda_part = match.groups()
    return f"torch {torch_part.replace('_', '.')}, CUDA {cuda_part.replace('_', '.')}"
