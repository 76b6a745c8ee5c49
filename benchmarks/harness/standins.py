"""Stand-ins for `sgl_kernel` and `flashinfer`, so the pinned SGLang imports on a GPU machine without them.

SGLang imports both at module import on CUDA machines (`layers/sampler.py`, quantization, layernorm...). Their
wheels are hundreds of MB, too large to carry to the lent GPU machines, and the distributed layer, the fusion
gate and `_forward_with_allreduce_fusion` (what the overlay's GPU tests exercise) do not need them.

`install()` puts a `sys.meta_path` finder in front, only for the packages that are really missing:
- `flashinfer.comm` and its submodules are NOT found, so SGLang treats FlashInfer's all-reduce fusion as
  unavailable, exactly as on a machine without it;
- every other `sgl_kernel.*` / `flashinfer.*` module is a stand-in whose attributes are stand-in classes,
  whose attributes are stand-ins again, and which RAISE when called: any accidental use of an SGLang kernel
  is loud. Dunder lookups raise AttributeError so `inspect`, `hasattr(x, "__version__")`, class definitions
  and pickling behave as for a missing attribute.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STANDIN_ROOTS = ("sgl_kernel", "flashinfer")
NOT_FOUND = ("flashinfer.comm",)  # and submodules


class StandInCalled(RuntimeError):
    """A stand-in of an SGLang GPU kernel was called: the code under test reached a kernel it should not."""


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _excluded(fullname: str, not_found: tuple[str, ...] = NOT_FOUND) -> bool:
    return any(fullname == name or fullname.startswith(name + ".") for name in not_found)


class _StandInMeta(type):
    """Metaclass of stand-ins: attribute access yields further stand-ins; calling raises."""

    def __getattr__(cls, name: str):
        if _is_dunder(name):
            raise AttributeError(name)
        child = _make_standin(f"{cls.__qualname__}.{name}", cls.__module__)
        type.__setattr__(cls, name, child)
        return child

    def __call__(cls, *args, **kwargs):
        raise StandInCalled(
            f"{cls.__module__}.{cls.__qualname__} is a stand-in (the real package is not installed here); "
            "the code under test called an SGLang kernel it should not need"
        )

    def __getitem__(cls, item):
        return cls

    def __repr__(cls):
        return f"<stand-in {cls.__module__}.{cls.__qualname__}>"


def _make_standin(qualname: str, module: str) -> type:
    standin = _StandInMeta(qualname.rsplit(".", 1)[-1], (), {"__module__": module})
    standin.__qualname__ = qualname
    return standin


def _module_getattr_for(module: types.ModuleType, not_found: tuple[str, ...] = NOT_FOUND):
    def __getattr__(name: str):
        if _is_dunder(name) or _excluded(f"{module.__name__}.{name}", not_found):
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        standin = _make_standin(name, module.__name__)
        setattr(module, name, standin)
        return standin

    return __getattr__


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...], not_found: tuple[str, ...] = NOT_FOUND):
        self.roots = roots
        self.not_found = not_found

    def _covers(self, fullname: str) -> bool:
        return any(fullname == root or fullname.startswith(root + ".") for root in self.roots)

    def find_spec(self, fullname, path=None, target=None):
        if not self._covers(fullname):
            return None
        if _excluded(fullname, self.not_found):
            # Not found: the parent stand-in's __path__ is empty, so no other finder finds it either.
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None  # default module creation

    def exec_module(self, module):
        module.__path__ = []  # a package, so submodule imports come back to this finder
        module.__file__ = f"<stand-in {module.__name__}>"
        module.__getattr__ = _module_getattr_for(module, self.not_found)


_installed: StandInFinder | None = None



def missing_roots() -> tuple[str, ...]:
    """The stand-in roots whose real package is not importable."""
    if _installed is not None:
        roots = tuple(r for r in STANDIN_ROOTS if r not in _installed.roots)
    else:
        roots = STANDIN_ROOTS
    return tuple(root for root in roots if importlib.util.find_spec(root) is None)


def install() -> tuple[str, ...]:
    """Install stand-ins for whichever of sgl_kernel / flashinfer is missing. Idempotent. Returns the roots
    now covered by stand-ins (empty when both real packages are installed)."""
    global _installed
    if _installed is not None:
        return _installed.roots
    roots = missing_roots()
    if not roots:
        return ()
    _installed = StandInFinder(roots)
    sys.meta_path.insert(0, _installed)
    return roots


def uninstall() -> None:
    global _installed
    if _installed is None:
        return
    try:
        sys.meta_path.remove(_installed)
    except ValueError:
        pass
    for name in list(sys.modules):
        if any(name == root or name.startswith(root + ".") for root in _installed.roots):
            del sys.modules[name]
    _installed = None


def installed_roots() -> tuple[str, ...]:
    return _installed.roots if _installed is not None else ()
