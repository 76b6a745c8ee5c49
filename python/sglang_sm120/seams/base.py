"""Applying and restoring a seam table: attribute replacements inside the installed SGLang.

A seam names `module:Owner.attribute` and a factory turning the original attribute into its replacement. The raw
attribute is read from the owner's `__dict__`, so staticmethod/classmethod descriptors reach the factory intact;
replacements are marked (`__sm120_seam__`) so a second activation never wraps a wrapper. Seams of modules not
imported yet are applied right after their first import (a `sys.meta_path` finder that runs the real loader, then
patches): activation stays cheap, and the overlay loads where such a module cannot be imported at all.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..hooks.installed import find_module_spec

logger = logging.getLogger("sglang_sm120")

MARK = "__sm120_seam__"
_MISSING = object()


@dataclass(frozen=True)
class Seam:
    """Why each seam exists: docs/overlay.md's table of its release (a test holds it to the seam tables)."""

    target: str  # "package.module:Owner.attribute" or "package.module:attribute"
    factory: Callable[[Any], Any]  # original (raw) -> replacement (raw)

    @property
    def module_name(self) -> str:
        return self.target.partition(":")[0]

    def locate(self) -> tuple[Any, str]:
        module_name, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, name


@dataclass
class _Applied:
    seam: Seam
    owner: Any
    name: str
    original: Any  # raw attribute from owner.__dict__, or _MISSING if it was inherited


_lock = threading.RLock()
_applied: list[_Applied] = []


class UnresolvedSeamTarget(AttributeError):
    """A seam (or a name a hook reads) the installed SGLang does not have, raised at activation: a target whose
    module never exists would otherwise stay pending forever, the overlay silently partial."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(
            "sglang_sm120: seam targets that do not resolve in the installed SGLang: " + "; ".join(problems)
        )


def target_problem(target: str) -> str | None:
    """Why `module:Owner.attr` does not resolve, or None (a module not imported yet is only located)."""
    module_name, _, path = target.partition(":")
    try:
        spec = find_module_spec(module_name)
    except (ImportError, ValueError) as exc:
        return f"{target}: locating module {module_name} failed ({type(exc).__name__}: {exc})"
    if spec is None:
        return f"{target}: module {module_name} not found"
    module = sys.modules.get(module_name)
    if module is None or not path:
        return None
    owner: Any = module
    walked = module_name
    for name in path.split("."):
        if not hasattr(owner, name):
            return f"{target}: {walked} has no attribute {name!r}"
        owner = getattr(owner, name)
        walked += f".{name}"
    return None


def check_resolvable(targets: list[str]) -> None:
    """Raise UnresolvedSeamTarget naming every target that does not resolve."""
    problems = [problem for problem in (target_problem(t) for t in targets) if problem is not None]
    if problems:
        raise UnresolvedSeamTarget(problems)


def _raw(owner: Any, name: str) -> Any:
    namespace = getattr(owner, "__dict__", {})
    if name in namespace:
        return namespace[name]
    return getattr(owner, name)  # inherited: the factory wraps what lookup finds


def _func(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw


def is_ours(raw: Any) -> bool:
    return getattr(_func(raw), MARK, None) is not None


def _apply_now(seams: list[Seam]) -> list[_Applied]:
    """Patch every seam or none: on failure the ones already applied are restored and the error raised."""
    done: list[_Applied] = []
    try:
        for seam in seams:
            owner, name = seam.locate()
            if not hasattr(owner, name):
                raise AttributeError(f"seam {seam.target}: SGLang has no such attribute")
            current = _raw(owner, name)
            if is_ours(current):
                continue
            replacement = seam.factory(current)
            setattr(_func(replacement), MARK, seam.target)
            had_own = name in getattr(owner, "__dict__", {})
            setattr(owner, name, replacement)
            done.append(_Applied(seam, owner, name, current if had_own else _MISSING))
    except Exception:
        _restore(done)
        raise
    return done


class _PatchAfterExec(importlib.abc.Loader):
    """A module's real loader for one import, then its pending seams."""

    def __init__(self, loader, finder: _DeferredSeamFinder, name: str):
        self._loader, self._finder, self._name = loader, finder, name

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # From here on introspection (inspect, linecache, pickle, reload) sees the real loader.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder.module_loaded(self._name)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _DeferredSeamFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: dict[str, list[Seam]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, self, fullname)
                return spec
        return None

    def module_loaded(self, name: str) -> None:
        with _lock:
            seams = self.pending.pop(name, [])
            if not seams:
                return
            try:
                _applied.extend(_apply_now(seams))
            except Exception:
                # Raising would break SGLang's import of its own module; the version check makes this a bug.
                logger.exception("sglang_sm120: patching %s after its import failed; its seams are NOT active", name)


_finder: _DeferredSeamFinder | None = None


def apply(seams: list[Seam]) -> int:
    """Patch the seams of imported modules now (all or none), the others right after their import; every target
    must resolve first (UnresolvedSeamTarget, nothing patched). Returns how many were patched now."""
    global _finder
    with _lock:
        check_resolvable([s.target for s in seams])
        now = [s for s in seams if s.module_name in sys.modules]
        later = [s for s in seams if s.module_name not in sys.modules]
        done = _apply_now(now)
        _applied.extend(done)
        if later:
            if _finder is None:
                _finder = _DeferredSeamFinder()
                sys.meta_path.insert(0, _finder)
            for seam in later:
                _finder.pending.setdefault(seam.module_name, []).append(seam)
        return len(done)


def _restore(entries: list[_Applied]) -> None:
    for entry in reversed(entries):
        if entry.original is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(entry.owner, entry.name)
        else:
            setattr(entry.owner, entry.name, entry.original)


def restore_all() -> None:
    global _finder
    with _lock:
        if _finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_finder)
            _finder = None
        _restore(_applied)
        _applied.clear()


def pending_targets() -> list[str]:
    with _lock:
        return [seam.target for seams in (_finder.pending.values() if _finder else []) for seam in seams]
