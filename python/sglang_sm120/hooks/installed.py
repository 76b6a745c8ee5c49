"""What the installed SGLang has, found without importing it: a module's spec, located on disk.

Standard library only: the seam machinery checks its targets with it before anything of SGLang is imported, and
the hooks ask it whether this SGLang has a module at all (e.g. its own PCIe-IPC all-reduce).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def find_module_spec(name: str):
    """The module's spec, found without importing it or its parent packages (a parent's `__init__` can be
    heavy, or fail where GPU-only packages are absent). Imported modules answer from sys.modules."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__spec__", None) or importlib.machinery.ModuleSpec(name, None)
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])  # a top-level name is located, not imported
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return None
        fullname = ".".join(parts[:depth])
        module = sys.modules.get(fullname)
        if module is not None:
            spec = getattr(module, "__spec__", None)
            continue
        spec = _find_child_spec(fullname, list(spec.submodule_search_locations))
    return spec


def _find_child_spec(fullname: str, locations: list[str]):
    try:
        return importlib.machinery.PathFinder.find_spec(fullname, locations)
    except KeyError:
        # A namespace portion (SGLang's `srt/` has no __init__.py): PathFinder builds its search path from the
        # parent module, which is not imported. Collect the portion's directories by hand.
        tail = fullname.rpartition(".")[2]
        dirs = [os.path.join(loc, tail) for loc in locations if os.path.isdir(os.path.join(loc, tail))]
        if not dirs:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = dirs
        return spec
