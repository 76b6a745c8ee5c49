"""Build checks (CPU; run in CI).

1. The built extension `sgl_kernel_sm120._C` loads and registers ops under `torch.ops.sgl_kernel_sm120`.
2. Every `csrc/*.cu` compiles with nvcc for sm_120a and sm_90a, and the objects hold both SASS ELFs.
3. The built `_C` shared object itself holds sm_120a and sm_90a ELFs.

A missing `_C` or nvcc fails these tests, unless SGL_SM120_ALLOW_NO_EXT=1 (then they skip).
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_SOURCES = sorted(glob.glob(os.path.join(REPO_ROOT, "csrc", "*.cu")))
ARCHS = ("sm_120a", "sm_90a")
ALLOW_NO_EXT = os.environ.get("SGL_SM120_ALLOW_NO_EXT") == "1"


def _missing(what: str) -> None:
    if ALLOW_NO_EXT:
        pytest.skip(f"{what} (SGL_SM120_ALLOW_NO_EXT=1)")
    pytest.fail(f"{what} (set SGL_SM120_ALLOW_NO_EXT=1 to skip this where the kernels cannot be built)", pytrace=False)


@functools.lru_cache(maxsize=1)
def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = os.path.join(cuda_home, "bin", "nvcc")
    return cand if os.access(cand, os.X_OK) else shutil.which("nvcc")


@functools.lru_cache(maxsize=1)
def _cuobjdump() -> str | None:
    """cuobjdump from the `nvidia-cuda-cuobjdump` wheel (pinned in requirements/ci.txt), else the toolkit's."""
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-cuobjdump")
        for f in dist.files or ():
            if f.name == "cuobjdump" and f.parent.name == "bin":
                path = str(dist.locate_file(f))
                if os.path.isfile(path):
                    if not os.access(path, os.X_OK):
                        os.chmod(path, 0o755)
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    nvcc = _nvcc()
    if nvcc and os.access(os.path.join(os.path.dirname(nvcc), "cuobjdump"), os.X_OK):
        return os.path.join(os.path.dirname(nvcc), "cuobjdump")
    return shutil.which("cuobjdump")


def _list_elf(path: str) -> list[str]:
    tool = _cuobjdump()
    if tool is None:
        _missing("cuobjdump not found: install the pinned `nvidia-cuda-cuobjdump` package")
    out = subprocess.run([tool, "--list-elf", path], capture_output=True, text=True)
    assert out.returncode == 0, f"cuobjdump --list-elf {path} failed:\n{out.stdout}\n{out.stderr}"
    return re.findall(r"\.(sm_\d+[af]?)\.cubin", out.stdout)


def _load_ext():
    import torch  # noqa: F401  (loads libtorch before the extension)

    try:
        return importlib.import_module("sgl_kernel_sm120._C")
    except ImportError as e:
        _missing(f"sgl_kernel_sm120._C is not built or does not load ({e}); run `make build`")


def test_extension_loads_and_registers_ops():
    import torch

    ext = _load_ext()
    assert ext.__file__ and ext.__file__.endswith(".so"), ext.__file__
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("sgl_kernel_sm120::"))
    assert ops, "torch.ops.sgl_kernel_sm120 has no ops: csrc/torch_bindings.cpp registered nothing"
    # each registered op resolves through torch.ops
    for name in ops:
        assert hasattr(torch.ops.sgl_kernel_sm120, name.split("::", 1)[1].split(".")[0]), name


def test_extension_has_sm120a_and_sm90a():
    ext = _load_ext()
    elfs = _list_elf(ext.__file__)
    for arch in ARCHS:
        assert arch in elfs, (
            f"{ext.__file__} lacks {arch} SASS (has {sorted(set(elfs))}); build with "
            "TORCH_CUDA_ARCH_LIST='9.0a;12.0a' (the Makefile's default)"
        )


def test_csrc_has_cuda_sources():
    assert CU_SOURCES, f"no CUDA sources in {os.path.join(REPO_ROOT, 'csrc')}/*.cu"


@pytest.mark.parametrize("src", CU_SOURCES, ids=[os.path.basename(s) for s in CU_SOURCES])
def test_cu_compiles_for_sm120a_and_sm90a(src, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        _missing("nvcc not found (set CUDA_HOME)")
    with open(src, encoding="utf-8", errors="replace") as f:
        uses_torch = re.search(r'#\s*include\s*[<"](torch|ATen|c10)/', f.read()) is not None
    cmd = [
        nvcc,
        "-c",
        "-O3",
        "-std=c++20" if uses_torch else "-std=c++17",
        "-lineinfo",
        "-I",
        os.path.join(REPO_ROOT, "csrc"),
    ]
    if uses_torch:  # same include paths as the extension build
        from torch.utils.cpp_extension import include_paths

        cmd += [f"-I{p}" for p in include_paths("cuda")]
    for arch in ARCHS:
        num = arch[len("sm_") :]
        cmd.append(f"-gencode=arch=compute_{num},code={arch}")
    obj = tmp_path / (os.path.basename(src) + ".o")
    cmd += [src, "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    elfs = _list_elf(str(obj))
    for arch in ARCHS:
        assert arch in elfs, f"{obj} lacks {arch} (cuobjdump lists {elfs})"


# The SGLang modules the overlay touches must import on a CPU-only machine with the pinned requirements
# (+ sglang installed --no-deps): this guards the pins, not the overlay. One list per supported SGLang.
SGLANG_MODULES = {
    "0.5.13.post1": (
        "sglang.srt.layers.communicator",
        "sglang.srt.layers.layernorm",
        "sglang.srt.server_args",
        "sglang.srt.distributed.parallel_state",
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.models.deepseek_v2",
        "sglang.srt.models.kimi_k25",
        "sglang.srt.plugins",
    ),
    "0.5.23": (
        "sglang.srt.layers.layer_boundary.fusions.allreduce",
        "sglang.srt.layers.layer_boundary.exit",
        "sglang.srt.layers.layer_boundary.stage",
        "sglang.srt.layers.layernorm",
        "sglang.srt.server_args",
        "sglang.srt.arg_groups.model_hook",
        "sglang.srt.distributed.parallel_state",
        "sglang.srt.distributed.device_communicators.pcie_ipc_ar",
        "sglang.srt.model_executor.runner.base_runner",
        "sglang.srt.models.deepseek_v2",
        "sglang.srt.models.kimi_k25",
        "sglang.srt.plugins",
    ),
}


def test_pinned_env_imports_sglang_modules():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (requirements/sglang-nodeps.txt)")
    version = importlib.metadata.version("sglang")
    if version not in SGLANG_MODULES:
        pytest.skip(f"no module list for sglang {version}")
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    res = subprocess.run([sys.executable, "-c", code, *SGLANG_MODULES[version]], capture_output=True, text=True)
    assert res.returncode == 0, f"importing SGLang modules failed:\n{res.stderr[-4000:]}"


def test_plugin_entry_point_declared():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert any(ep.name == "sm120_allreduce" and ep.value == "sglang_sm120.plugin:activate" for ep in eps), (
        f"entry point sglang.srt.plugins/sm120_allreduce missing ({list(eps)}): run `pip install -e .`"
    )
