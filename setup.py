"""Build script of the `sglang-sm120` distribution.

Metadata lives in pyproject.toml; this file declares the two packages, the CUDA extension and the torch
dependency. The extension is named after the torch it is built against (`sgl_kernel_sm120._C_torch<ver>_cuda<ver>`,
see sgl_kernel_sm120/_abi.py), and the install then requires exactly that torch release: a library built for
one torch does not load under another, so pip must not pair them.

The build is all or nothing: when the kernels cannot be built (no torch, a CPU-only torch, no nvcc, a compile
error) the install fails and says what is missing. SGL_SM120_SKIP_EXT=1 asks for a Python-only install.

Environment:
  TORCH_CUDA_ARCH_LIST  e.g. "9.0a;12.0a" (entries X.Y[a|f][+PTX]); default: 12.0a plus each visible GPU.
  CUDA_HOME             CUDA toolkit root holding bin/nvcc (default: torch's guess, /usr/local/cuda).
  SGL_SM120_SKIP_EXT=1  install the Python parts only; calling a kernel then raises KernelsNotBuiltError.
  MAX_JOBS              parallel compile jobs (ninja), as usual for torch extensions.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
SKIP_ENV = "SGL_SM120_SKIP_EXT"
BUILD_HINT = (
    "Needed to build the kernels: a CUDA build of torch (the default isolated build installs the one pyproject.toml "
    "names, CUDA 13.0) and an nvcc of the same CUDA major version, 13.x for it (torch refuses another major; "
    "export CUDA_HOME=/usr/local/cuda). For a Python-only install set SGL_SM120_SKIP_EXT=1."
)


def _load_abi():
    # sgl_kernel_sm120/__init__.py imports torch and the extension: load the naming helper on its own.
    spec = importlib.util.spec_from_file_location("_sgl_sm120_abi", os.path.join(ROOT, "sgl_kernel_sm120", "_abi.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packages() -> tuple[list[str], dict[str, str]]:
    package_dir = {"sglang_sm120": "python/sglang_sm120", "sgl_kernel_sm120": "sgl_kernel_sm120"}
    pkgs = []
    for name, src in package_dir.items():
        pkgs += [name] + [f"{name}.{sub}" for sub in find_packages(os.path.join(ROOT, src))]
    return pkgs, package_dir


def _fail(reason: str) -> None:
    bar = "=" * 100
    raise SystemExit(f"\n{bar}\nsglang-sm120: cannot build the CUDA kernels: {reason}\n{BUILD_HINT}\n{bar}\n")


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
            _fail(f"TORCH_CUDA_ARCH_LIST entry {arch!r} is not of the form X.Y[a|f][+PTX]")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _nvidia_wheel_includes(cuda_home: str, torch_dir: str) -> list[str]:
    """ATen's CUDA headers include cuBLAS/cuSPARSE/cuSOLVER headers. A bare nvcc toolkit may lack them while
    torch's `nvidia-*` wheels ship them, next to copies of the CUDA runtime headers that must NOT shadow nvcc's
    own (adding the whole wheel include folder breaks nvcc 13.0). So expose only those three libraries' headers,
    through a folder of copies under build/. The wheels sit beside torch (in pip's isolated build environment
    too, whose folder is not one of `site.getsitepackages()`), and that environment is deleted after the build:
    links into it would dangle, copies do not."""
    if os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        return []
    import site

    roots = [os.path.dirname(torch_dir)] + site.getsitepackages() + [site.getusersitepackages()]
    headers: dict[str, str] = {}
    for root in dict.fromkeys(r for r in roots if os.path.isdir(r)):
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
        shutil.copy2(src, dst)
    return [stage]


def _extension():
    """Return (ext_modules, cmdclass, install_requires, options)."""
    if os.environ.get(SKIP_ENV) == "1":
        return [], {}, ["torch>=2.9"], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cu")) + glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        _fail("no sources in csrc/")
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        _fail(f"torch is not importable in the build environment ({e}); with --no-build-isolation, install "
              "torch first (the release your SGLang pins)")
    if torch.version.cuda is None:
        _fail(f"torch {torch.__version__} in the build environment has no CUDA support")
    cuda_home = cpp_extension.CUDA_HOME
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        _fail(f"nvcc not found (CUDA_HOME={cuda_home!r})")

    abi = _load_abi()
    module = abi.extension_module(torch.__version__, torch.version.cuda)
    archs = _arch_list(torch)
    cu_sources = [s for s in sources if s.endswith(".cu")]
    # Kernels are plain CUDA (C++17). torch's own headers need C++20: use it if a .cu includes them.
    uses_torch = any(
        re.search(r'#\s*include\s*[<"](torch|ATen|c10)/', Path(s).read_text(encoding="utf-8", errors="replace"))
        for s in cu_sources
    )
    nvcc_std = "-std=c++20" if uses_torch else "-std=c++17"
    nvcc_flags = ["-O3", nvcc_std, "-lineinfo", *_gencode_flags(archs)]
    torch_release = torch.__version__.split("+", 1)[0]
    print(f"sglang-sm120: building sgl_kernel_sm120.{module} for {';'.join(archs)} with {cuda_home}/bin/nvcc "
          f"against torch {torch.__version__}", file=sys.stderr)

    ext = cpp_extension.CUDAExtension(
        name=f"sgl_kernel_sm120.{module}",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), *_nvidia_wheel_includes(cuda_home, os.path.dirname(torch.__file__))],
        # cxx: torch adds -std=c++20 (its headers require it)
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
        py_limited_api=False,
    )
    record = {
        "module": f"sgl_kernel_sm120.{module}",
        "archs": archs,
        "gencode": _gencode_flags(archs),
        "nvcc": os.path.join(cuda_home, "bin", "nvcc"),
        "nvcc_release": _nvcc_release(cuda_home),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    build_ext = _recording_build_ext(cpp_extension.BuildExtension.with_options(use_ninja=_have_ninja()), record)
    # One build folder per torch, so environments sharing this checkout never reuse each other's objects.
    options = {"build": {"build_base": os.path.join("build", abi.extension_tag(torch.__version__, torch.version.cuda))}}
    return [ext], {"build_ext": build_ext}, [f"torch=={torch_release}"], options


# Written next to each built library: pip shows none of the build's output, so this is where the user (and
# `python -m sglang_sm120.doctor`) learns which architectures were compiled, with which nvcc, against which torch.
BUILD_RECORD_SUFFIX = ".build.json"


def _nvcc_release(cuda_home: str) -> str | None:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _recording_build_ext(base, record: dict):
    """`base` (torch's build_ext) that also writes `record` as <module>.build.json beside every library it builds:
    in the build folder (what a wheel installs, and `setup.py build_ext --build-lib DIR`), and in the source
    tree when it copies the library there (editable installs)."""

    class BuildExt(base):
        def run(self):
            super().run()
            inplace = self.inplace
            for ext in self.extensions:
                for self.inplace in dict.fromkeys((0, inplace)):
                    library = self.get_ext_fullpath(ext.name)
                    if os.path.exists(library):
                        module = os.path.basename(library).split(".", 1)[0]
                        path = os.path.join(os.path.dirname(library), module + BUILD_RECORD_SUFFIX)
                        with open(path, "w", encoding="utf-8") as handle:
                            json.dump(record, handle, indent=1)
                            handle.write("\n")
            self.inplace = inplace

    return BuildExt


def _have_ninja() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return is_ninja_available()
    except Exception:
        return False


packages, package_dir = _packages()
ext_modules, cmdclass, install_requires, options = _extension()

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=install_requires,
    options=options,
    zip_safe=False,
)
