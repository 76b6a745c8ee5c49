"""Build script of the `sglang-sm120` distribution.

Metadata lives in pyproject.toml; this file only declares the two packages and the CUDA extension
`sgl_kernel_sm120._C`. The extension is built when torch (with CUDA) and nvcc are available at build time
(install with `pip install --no-build-isolation -e .`); otherwise the pure-Python parts install alone and
one message says how to build the kernels.

Environment:
  TORCH_CUDA_ARCH_LIST  e.g. "9.0a;12.0a" (entries X.Y[a|f][+PTX]); default: 12.0a plus each visible GPU.
  CUDA_HOME             CUDA toolkit root holding bin/nvcc (default: torch's guess, /usr/local/cuda).
  SGL_SM120_SKIP_EXT=1  install the Python parts only, without trying to build `_C`.
  MAX_JOBS              parallel compile jobs (ninja), as usual for torch extensions.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "sgl_kernel_sm120._C"
BUILD_HINT = (
    "To build them: install a CUDA build of torch, make nvcc available (export CUDA_HOME=/usr/local/cuda), "
    "then run `pip install --no-build-isolation -e .` (or `make build`)."
)


def _packages() -> tuple[list[str], dict[str, str]]:
    package_dir = {"sglang_sm120": "python/sglang_sm120", "sgl_kernel_sm120": "sgl_kernel_sm120"}
    pkgs = []
    for name, src in package_dir.items():
        pkgs += [name] + [f"{name}.{sub}" for sub in find_packages(os.path.join(ROOT, src))]
    return pkgs, package_dir


# pip runs this file once per build hook (requires, metadata, build): say it once, in the build step.
_BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def _skip(reason: str) -> None:
    if not _BUILD_COMMANDS.intersection(sys.argv[1:]):
        return
    bar = "=" * 100
    print(
        f"\n{bar}\nsglang-sm120: the CUDA kernels (sgl_kernel_sm120._C) were NOT built: {reason}\n"
        f"The Python packages are installed; calling a kernel will raise an error.\n{BUILD_HINT}\n{bar}\n",
        file=sys.stderr,
        flush=True,
    )


def _arch_list(torch) -> list[str]:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a for a in re.split(r"[;\s,]+", env) if a]
    archs = ["12.0a"]
    try:
        n = torch.cuda.device_count()
    except Exception:  # no driver: build for the default list only
        n = 0
    for i in range(n):
        major, minor = torch.cuda.get_device_capability(i)
        arch = f"{major}.{minor}" + ("a" if major >= 9 else "")
        if arch not in archs:
            archs.append(arch)
    return archs


def _gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", arch)
        if not m:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {arch!r} is not of the form X.Y[a|f][+PTX]")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _nvidia_wheel_includes(cuda_home: str) -> list[str]:
    """ATen's CUDA headers include cuBLAS/cuSPARSE/cuSOLVER headers. A bare nvcc toolkit may lack them while
    torch's `nvidia-*` wheels ship them, next to copies of the CUDA runtime headers that must NOT shadow nvcc's
    own (adding the whole wheel include folder breaks nvcc 13.0). So expose only those three libraries' headers,
    through a folder of symlinks under build/."""
    if os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        return []
    import site

    roots = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    headers: dict[str, str] = {}
    for root in roots:
        for inc in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include"))):
            for pat in ("cublas*.h", "cusparse*.h", "cusolver*.h"):
                for h in glob.glob(os.path.join(inc, pat)):
                    headers.setdefault(os.path.basename(h), h)
    if not headers:
        return []
    stage = os.path.join(ROOT, "build", "nvidia-math-include")
    os.makedirs(stage, exist_ok=True)
    for name, src in headers.items():
        dst = os.path.join(stage, name)
        if os.path.islink(dst) or os.path.exists(dst):
            os.remove(dst)
        os.symlink(src, dst)
    return [stage]


def _extension():
    """Return (ext_modules, cmdclass); empty when the kernels cannot be built here."""
    if os.environ.get("SGL_SM120_SKIP_EXT") == "1":
        _skip("SGL_SM120_SKIP_EXT=1 is set")
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cu")) + glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        _skip("no sources in csrc/")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        _skip(f"torch is not importable at build time ({e}); with pip, use --no-build-isolation")
        return [], {}
    if torch.version.cuda is None:
        _skip(f"torch {torch.__version__} has no CUDA support")
        return [], {}
    cuda_home = cpp_extension.CUDA_HOME
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        _skip(f"nvcc not found (CUDA_HOME={cuda_home!r})")
        return [], {}

    archs = _arch_list(torch)
    cu_sources = [s for s in sources if s.endswith(".cu")]
    # Kernels are plain CUDA (C++17). torch's own headers need C++20: use it if a .cu includes them.
    uses_torch = any(
        re.search(r'#\s*include\s*[<"](torch|ATen|c10)/', Path(s).read_text(encoding="utf-8", errors="replace"))
        for s in cu_sources
    )
    nvcc_std = "-std=c++20" if uses_torch else "-std=c++17"
    nvcc_flags = ["-O3", nvcc_std, "-lineinfo", *_gencode_flags(archs)]
    if _BUILD_COMMANDS.intersection(sys.argv[1:]):
        print(f"sglang-sm120: building {EXT_NAME} for {';'.join(archs)} with {cuda_home}/bin/nvcc", file=sys.stderr)

    ext = cpp_extension.CUDAExtension(
        name=EXT_NAME,
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), *_nvidia_wheel_includes(cuda_home)],
        # cxx: torch adds -std=c++20 (its headers require it)
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
        py_limited_api=False,
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=_have_ninja())}


def _have_ninja() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return is_ninja_available()
    except Exception:
        return False


packages, package_dir = _packages()
ext_modules, cmdclass = _extension()

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
