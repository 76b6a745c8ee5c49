"""Build checks (CPU; run in CI).

1. The extension built for the running torch (`sgl_kernel_sm120._C_torch<ver>_cuda<ver>`) loads and registers
   ops under `torch.ops.sgl_kernel_sm120`.
2. The built library holds sm_120a and sm_90a SASS for every `csrc/*.cu` translation unit: the build itself is
   the compile check (compiling the sources a second time here would only repeat it).

A missing extension or cuobjdump fails these tests, unless SGL_SM120_ALLOW_NO_EXT=1 (then they skip).
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
    """cuobjdump from the `nvidia-cuda-cuobjdump` wheel (pinned in requirements/<stack>/ci.txt), else the toolkit's."""
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


def _built_library() -> str:
    """Path of the library this process loads: the one `make` builds out of the tree for each stack (named by
    SGL_SM120_EXT_LIBRARY), else the in-tree one named for the running torch (a `pip install -e .`)."""
    import torch  # noqa: F401  (loads libtorch before the extension)

    from sgl_kernel_sm120 import _ext, settings

    override = settings.read().library
    if override:
        if not _ext.kernels_available():
            _missing(f"{_ext.unavailable_reason()} (run `make build`)")
        return override
    try:
        return importlib.import_module(f"sgl_kernel_sm120.{_ext.expected_module()}").__file__
    except ImportError:
        _missing(f"{_ext.unavailable_reason()} (run `make build`)")


def test_extension_loads_and_registers_ops():
    import torch

    from sgl_kernel_sm120 import _ext

    path = _built_library()
    # built for this very torch: the name says so, whichever way it was loaded
    assert os.path.basename(path).startswith(_ext.expected_module() + "."), path
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("sgl_kernel_sm120::"))
    assert ops, "torch.ops.sgl_kernel_sm120 has no ops: csrc/torch_bindings.cpp registered nothing"
    # each registered op resolves through torch.ops
    for name in ops:
        assert hasattr(torch.ops.sgl_kernel_sm120, name.split("::", 1)[1].split(".")[0]), name


def test_extension_has_sm120a_and_sm90a_for_every_source():
    path = _built_library()
    elfs = _list_elf(path)
    assert CU_SOURCES, f"no CUDA sources in {os.path.join(REPO_ROOT, 'csrc')}/*.cu"
    for arch in ARCHS:
        # one cubin per arch per translation unit with device code (every csrc/*.cu has kernels)
        assert elfs.count(arch) >= len(CU_SOURCES), (
            f"{path} holds {elfs.count(arch)} {arch} cubins for {len(CU_SOURCES)} .cu files (all ELFs: "
            f"{sorted(elfs)}); build with TORCH_CUDA_ARCH_LIST='9.0a;12.0a' (the Makefile's default)"
        )


def _resource_usage(path: str) -> list[tuple[str, str, int, int]]:
    """(arch, function, registers, stack bytes) of every function in the library's cubins."""
    tool = _cuobjdump()
    if tool is None:
        _missing("cuobjdump not found: install the pinned `nvidia-cuda-cuobjdump` package")
    out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
    assert out.returncode == 0, f"cuobjdump -res-usage {path} failed:\n{out.stdout}\n{out.stderr}"
    rows, arch, function = [], None, None
    for line in out.stdout.splitlines():
        if m := re.match(r"\s*arch = (sm_\d+[af]?)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function ([^:\s]+):", line):
            function = m.group(1)
            if "REG:" in line:  # some cuobjdump versions print the counts on the same line
                line = line.split(":", 1)[1]
        if function and (m := re.search(r"REG:(\d+)\s+STACK:(\d+)", line)):
            rows.append((arch, function, int(m.group(1)), int(m.group(2))))
            function = None
    return rows


def test_no_kernel_spills_to_local_memory():
    """A spill is a local-memory round trip inside the polling loops. Every kernel must fit its
    registers (the launch bounds decide how many: 64 per thread at 1024 threads, 128 at 512) with a stack
    frame of 0 bytes on both targets; csrc/ar_kernels.cu says how each kernel stays within them."""
    rows = _resource_usage(_built_library())
    kernels = [r for r in rows if "_kernel" in r[1]]
    assert kernels, "cuobjdump -res-usage listed no kernels"
    for arch in ARCHS:
        fused = [r for r in kernels if r[0] == arch and "add_rmsnorm_kernel" in r[1]]
        assert fused, f"no fused kernels found for {arch}"
    spilling = [f"{arch} {name}: REG {regs} STACK {stack}" for arch, name, regs, stack in kernels if stack]
    assert not spilling, "kernels with a stack frame (spills):\n" + "\n".join(spilling)


# The 1024-thread fused kernels sit at exactly 64 of their 64 registers, so a spill could appear
# with another toolkit. README asks for an nvcc of torch's CUDA major; with a CUDA 12 build of torch that is 12.x,
# and 12.8 is the oldest that knows sm_120. Registers and
# spills are decided by ptxas, and the pinned `nvidia-cuda-nvcc-cu12` wheel carries ptxas 12.8 (not the nvcc
# front end): so the sources' sm_120a PTX, from this toolkit's front end, is assembled again by ptxas 12.8 (at
# PTX ISA 8.7, the newest it reads) and must not spill there either.
OLDEST_PTXAS_DIST = "nvidia-cuda-nvcc-cu12"
NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]  # what torch's extension build passes


def _oldest_ptxas() -> str | None:
    try:
        dist = importlib.metadata.distribution(OLDEST_PTXAS_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "ptxas" and f.parent.name == "bin":
            path = str(dist.locate_file(f))
            if not os.access(path, os.X_OK):
                os.chmod(path, 0o755)
            return path
    return None


def test_no_kernel_spills_with_the_oldest_supported_ptxas(tmp_path):
    ptxas = _oldest_ptxas()
    if ptxas is None:
        pytest.skip(f"{OLDEST_PTXAS_DIST} (ptxas 12.8) is pinned in requirements/sglang-0.5.23/ci.txt: this check runs "
                    "in that stack")
    nvcc = _nvcc()
    if nvcc is None:
        _missing("nvcc not found")
    spills = []
    for source in CU_SOURCES:
        ptx = tmp_path / (os.path.basename(source) + ".ptx")
        command = [nvcc, "-std=c++17", "-O3", "-arch=sm_120a", *NVCC_DEFINES, "-ptx", source, "-o", str(ptx)]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, f"nvcc -ptx {source}:\n{done.stderr[-3000:]}"
        text = re.sub(r"^\.version \d+\.\d+", ".version 8.7", ptx.read_text(), count=1, flags=re.M)
        ptx.write_text(text)
        done = subprocess.run([ptxas, "-arch=sm_120a", "-O3", "-v", str(ptx), "-o", str(ptx) + ".cubin"],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"ptxas 12.8 {source}:\n{done.stderr[-3000:]}"
        for entry in done.stderr.split("Compiling entry function")[1:]:
            name = re.search(r"'(\S+)'", entry).group(1)
            stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", entry)
            if stack and (int(stack.group(1)) or int(stack.group(2))):
                spills.append(f"{name}: {stack.group(0)}")
    assert not spills, "kernels that spill with ptxas 12.8:\n" + "\n".join(spills)


def test_fused_cluster_rule_is_a_pure_function_of_the_call_shape():
    """The fused one-shot's CTAs per row: the largest of 8, 4, 2 whose clusters all run in one wave (rows x cluster
    within the call's CTA cap, rows within the group's capacity for that size where clusters launch), at least 2
    warps of packs per CTA, else one CTA per row, always for rows wider than 8192 (csrc/ar_kernels.cu
    fused_cluster_size, read through the op the extension registers)."""
    _built_library()
    from sgl_kernel_sm120 import _ext

    rule = _ext.ops().fused_cluster_for
    rows = (1, 3, 4, 16, 17, 33, 34, 64, 67, 257)
    assert [rule(r, 7168, 132) for r in rows] == [8, 8, 8, 8, 4, 4, 2, 2, 1, 1]
    assert rule(3, 7168, 188) == 8 and rule(24, 7168, 188) == 4  # RTX PRO 6000: 188 SMs
    assert rule(1, 2048, 132) == 4  # 256 packs: 8 CTAs would get one warp each
    assert rule(1, 1024, 132) == 2  # 128 packs: 4 CTAs would get one warp each
    assert rule(1, 512, 132) == 1  # 64 packs: even 2 CTAs would get one warp each
    assert rule(1, 8, 132) == 1 and rule(1, 16384, 132) == 1
    # The group holds 15 clusters of 8 at once: 16 rows would loop, so 4 (I8); with 16 it is 8 again. A size the
    # group does not launch as clusters (capacity 0: the grouped kernel) has no such bound.
    assert rule(16, 7168, 132, [66, 33, 15]) == 4 and rule(16, 7168, 132, [66, 33, 16]) == 8
    assert rule(16, 7168, 132, [66, 0, 15]) == 4 and rule(16, 7168, 132, [0, 0, 0]) == 8
    # Staged push's 8-CTA cap: 8 at one row, 2 at three, one CTA per row at sixteen.
    assert [rule(r, 7168, 8) for r in (1, 3, 16)] == [8, 2, 1]


# The SGLang modules the overlay touches (every module of the installed version's seam table, and the model files
# of the target model) must import on a CPU-only machine with the stack's requirements (+ sglang installed
# --no-deps): this guards the pins, not the overlay.
EXTRA_SGLANG_MODULES = ("sglang.srt.models.deepseek_v2", "sglang.srt.models.kimi_k25", "sglang.srt.plugins")


def test_pinned_env_imports_sglang_modules():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (requirements/<stack>/sglang-nodeps.txt)")
    from sglang_sm120 import seams

    modules = sorted({seam.module_name for seam in seams.load_table().SEAMS} | set(EXTRA_SGLANG_MODULES))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    res = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True)
    assert res.returncode == 0, f"importing SGLang modules failed:\n{res.stderr[-4000:]}"


def test_plugin_entry_point_declared():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert any(ep.name == "sm120_allreduce" and ep.value == "sglang_sm120.plugin:activate" for ep in eps), (
        f"entry point sglang.srt.plugins/sm120_allreduce missing ({list(eps)}): run `pip install -e .`"
    )


def _setup_py(args, tmp_path, **env):
    run_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "setup.py", *args], cwd=REPO_ROOT, env=run_env, capture_output=True,
                          text=True, timeout=300)


def test_install_fails_saying_what_is_missing_when_nvcc_is_absent(tmp_path):
    res = _setup_py(["-q", "egg_info", "--egg-base", str(tmp_path)], tmp_path, CUDA_HOME=str(tmp_path / "no-cuda"))
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "cannot build the CUDA kernels: nvcc not found" in out and "SGL_SM120_SKIP_EXT=1" in out, out


def test_install_pins_the_torch_the_kernels_are_built_against(tmp_path):
    import torch

    if _nvcc() is None:
        _missing("nvcc not found (set CUDA_HOME)")
    res = _setup_py(["-q", "egg_info", "--egg-base", str(tmp_path)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (requires,) = glob.glob(str(tmp_path / "*.egg-info" / "requires.txt"))
    first = open(requires).read().split("\n[", 1)[0].split()
    assert first == [f"torch=={torch.__version__.split('+')[0]}"], first
    skipped = _setup_py(["-q", "egg_info", "--egg-base", str(tmp_path)], tmp_path, SGL_SM120_SKIP_EXT="1",
                        CUDA_HOME=str(tmp_path / "no-cuda"))
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
