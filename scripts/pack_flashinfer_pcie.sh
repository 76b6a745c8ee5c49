#!/usr/bin/env bash
# Pack the part of FlashInfer 0.7.2 that flashinfer.comm.PcieIpcAllReduceWorkspace needs, for a GPU machine that
# has no FlashInfer and no package registry (the device tool's H200 machines): the benchmark peer
# `flashinfer_pcie_ipc` (benchmarks/peers.py) then runs there. The whole wheel (~65 MB zipped, ~590 MB installed)
# does not fit the 64 MiB that travels with the repository; this trimmed copy is a few MiB.
#
#   PY=/path/to/python-with-torch bash scripts/pack_flashinfer_pcie.sh
#
# Writes (both under .fi/, which .gitignore ignores; the script replaces them on every run):
#   .fi/site/    a trimmed `flashinfer` package: the Python modules that `import flashinfer.comm` loads plus those the
#                PCIe IPC all-reduce imports later (found by running the import, not listed by hand), and the
#                C++/CUDA sources and headers its JIT build gen_pcie_ipc_comm_module() compiles (found with
#                `nvcc -M` on the spec's own compile command), with every include folder the spec names present.
#                .fi/site/flashinfer_pack_manifest.json says what went in and from which wheel.
#   .fi/wheels/  the import-time dependencies the GPU machine lacks, as cp312 manylinux x86_64 wheels (today only
#                apache-tvm-ffi; its other needs, and everything else flashinfer.comm imports, are on that image).
# Then it checks, on this machine (CPU only, any Python with torch, e.g. a venv of one of the SGLang stacks), in a
# Python that sees only .fi/site, the same tvm-ffi built for this interpreter, and those of this interpreter's
# packages that the GPU image also has (the list below; python -S, nothing else on sys.path):
#   1. `from flashinfer.comm import PcieIpcAllReduceWorkspace` imports, from .fi/site, and so do the modules the
#      PCIe code imports inside its functions;
#   2. every source file and include folder of the JIT spec (gen_pcie_ipc_comm_module(), read from flashinfer
#      itself) exists inside .fi/site;
#   3. unless SKIP_COMPILE=1: flashinfer's own JIT build of that spec (JitSpec.build(): ninja + nvcc + link) runs
#      for sm_90a and sm_120f (CHECK_ARCHS) from the trimmed copy, the full wheel's files already deleted, so a
#      missing header fails it. Only the build runs here: loading the .so needs libcuda, i.e. a GPU.
# Needs: network access to the package index (pip download), unzip, nvcc ($CUDA_HOME, default /usr/local/cuda) and
# ninja for check 3. Versions are pinned below.
#
# On the GPU machine, through the device tool (the folder is git-ignored, so it must be carried):
#   run(carry=[".fi"], command="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi-deps \
#        .fi/wheels/*.whl && export PYTHONPATH=$PWD/.fi/site:/tmp/fi-deps:$PYTHONPATH && ...")
# scripts/gpu_suite.sh does exactly that when .fi/site exists, so `OUT=... bash scripts/gpu_suite.sh bench` with
# carry [".fi"] (and ".whl" where the SGLang stack's wheels are needed too) gives the bench stage this peer.
# The first use there JIT-builds the module (CUDA_HOME=/usr/local/cuda) into ~/.cache/flashinfer
# (FLASHINFER_WORKSPACE_BASE moves it). tvm-ffi: .whl's SGLang 0.5.13.post1 pins 0.1.9, FlashInfer 0.7.2 asks >= 0.1.11;
# one process loads one, the first on PYTHONPATH (gpu_suite.sh puts .fi's first, for the bench stage only).
# Seen on an H200 machine (Python 3.12.3, torch 2.11.0+cu130): .fi's wheel installed, the import came
# from .fi/site, and get_pcie_ipc_comm_module() JIT-built and loaded the module in 11 s. Not yet run there: the
# collective itself (it needs 2, 4 or 8 GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
FLASHINFER_VERSION=0.7.2
DEPS_FOR_GPU=("apache-tvm-ffi==0.1.11")  # flashinfer_python 0.7.2 asks apache-tvm-ffi>=0.1.11,<0.2
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CHECK_ARCHS=${CHECK_ARCHS:-9.0a 12.0f}  # what check 3 builds for: the H200s, and SM120 (CUDA >= 12.9 spells it 12.0f)
# Python distributions on the GPU machines' image ('cuda').
# Only these of this interpreter's packages are visible to the check, so that it sees what the GPU machine sees.
GPU_IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp"

"$PY" -c "import torch" 2>/dev/null || { echo "PY=$PY has no torch: set PY to a Python with torch"; exit 1; }
command -v unzip > /dev/null || { echo "unzip is needed"; exit 1; }
TMP=$(mktemp -d /tmp/fi-pack.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/py"  # the helper scripts below; a folder of their own, as it heads their sys.path
PIP_NOISE="is ignored: it is neither a file nor a directory"
pip_dl() { "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "$@" 2>&1 \
  | { grep -v "$PIP_NOISE" || true; }; }

echo ">>> downloading flashinfer_python==$FLASHINFER_VERSION and ${DEPS_FOR_GPU[*]}"
pip_dl -d "$TMP/dl" "flashinfer_python==$FLASHINFER_VERSION"
# for the GPU machine: CPython 3.12, x86_64 (the recipe in the device tool's README)
pip_dl -d "$TMP/gpu" --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${DEPS_FOR_GPU[@]}"
# the same versions built for this interpreter, for the check here only
pip_dl -d "$TMP/host" "${DEPS_FOR_GPU[@]}"
FI_WHEEL=$(ls "$TMP"/dl/flashinfer_python-"$FLASHINFER_VERSION"-*.whl)
[ "$(ls "$TMP"/gpu/*.whl | wc -l)" -eq "${#DEPS_FOR_GPU[@]}" ] \
  || { echo "expected ${#DEPS_FOR_GPU[@]} GPU wheels"; exit 1; }
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$TMP/hostdeps" \
  "$TMP"/host/*.whl
unzip -q "$FI_WHEEL" -d "$TMP/full"

# A folder that holds (as links) only those of this interpreter's distributions that the GPU image has too.
cat > "$TMP/py/fipack_farm.py" << 'EOF'
import importlib.metadata as md, os, pathlib, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
wanted = {norm(n) for n in sys.argv[2].split()}
farm = pathlib.Path(sys.argv[1])
seen = set()
for d in md.distributions():
    name = norm(d.metadata["Name"] or "")
    if name not in wanted or name in seen:
        continue
    seen.add(name)
    for f in d.files or []:
        parts = pathlib.PurePath(f).parts
        if not parts or parts[0] == ".." or "__pycache__" in parts:
            continue
        src, dst = pathlib.Path(d.locate_file(f)), farm / f
        if src.is_file() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src, dst)
print(f"    {len(seen)} of this interpreter's distributions are also on the GPU image")
EOF
"$PY" "$TMP/py/fipack_farm.py" "$TMP/farm" "$GPU_IMAGE_PACKAGES"

# What to copy, found by running flashinfer (from the full wheel) the way the GPU machine would.
cat > "$TMP/py/fipack_trace.py" << 'EOF'
"""Import flashinfer.comm + PcieIpcAllReduceWorkspace, follow the imports the PCIe code makes inside its functions,
ask the JIT spec for its compile command, and list the package files all of that needs (relative paths)."""
import ast, importlib, json, os, pathlib, shlex, subprocess, sys

pkg_root = pathlib.Path(sys.argv[1]).resolve()  # the folder holding flashinfer/
out = pathlib.Path(sys.argv[2])
opened = set()


def audit(event, args):
    if event == "open" and isinstance(args[0], str):
        opened.add(args[0])


sys.addaudithook(audit)
import flashinfer.comm  # noqa: E402
from flashinfer.comm import PcieIpcAllReduceWorkspace  # noqa: E402,F401


def fi_modules():
    return {n: m for n, m in list(sys.modules.items()) if n == "flashinfer" or n.startswith("flashinfer.")}


def imported_names(mod):
    """flashinfer modules that mod imports anywhere (module level or inside functions)."""
    names = set()
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    pkg = mod.__name__ if mod.__file__.endswith("__init__.py") else mod.__name__.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "flashinfer"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flashinfer":
                continue
            names.add(target)
            names |= {f"{target}.{a.name}" for a in node.names}  # `from .x import y` may name a module y
    return names


# the PCIe all-reduce's own modules: follow every flashinfer import they make, also the lazy ones
lazy, referenced, done, failed = set(), set(), set(), {}
while True:
    todo = [m for n, m in fi_modules().items() if "pcie_ipc" in n and n not in done and getattr(m, "__file__", None)]
    if not todo:
        break
    for m in todo:
        done.add(m.__name__)
        for name in sorted(imported_names(m)):
            if name in failed:
                continue
            if name in sys.modules:
                referenced.add(name)
                continue
            try:
                importlib.import_module(name)
                lazy.add(name)
                referenced.add(name)
            except ImportError as e:  # an attribute, not a module (`from .x import y`), or a real miss
                failed[name] = repr(e)

from flashinfer.jit.comm import gen_pcie_ipc_comm_module  # noqa: E402
from flashinfer.jit import cpp_ext  # noqa: E402

spec = gen_pcie_ipc_comm_module()
files = set()
for n, m in fi_modules().items():
    f = getattr(m, "__file__", None)
    if f:
        files.add(pathlib.Path(f).resolve())
files |= {pathlib.Path(p).resolve() for p in opened if p.endswith(".json") or p.endswith(".txt")}
files |= {pathlib.Path(s).resolve() for s in spec.sources}

# headers: nvcc -M on the spec's own compile command, for two targets (the include graph has no arch conditions
# today; the union keeps it right if one appears)
for entry in spec.get_compile_commands():
    argv = shlex.split(entry["command"])
    i = argv.index("-o")
    argv = [a for a in argv[:i] + argv[i + 2 :] if a != "-c"]
    for arch in ("-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_120a,code=sm_120a"):
        dep = subprocess.run(
            [a for a in argv if not a.startswith("-gencode=")] + [arch, "-M"],
            check=True, capture_output=True, text=True,
        ).stdout
        for tok in dep.replace("\\\n", " ").split()[1:]:
            files.add(pathlib.Path(tok).resolve())

inside = sorted(str(f.relative_to(pkg_root)) for f in files if f.is_relative_to(pkg_root) and f.is_file())
include_dirs = [str(pathlib.Path(str(d)).resolve().relative_to(pkg_root))
                for d in cpp_ext.get_cccl_includes() + cpp_ext.get_system_includes(os.environ["CUDA_HOME"])
                if pathlib.Path(str(d)).resolve().is_relative_to(pkg_root)]
include_dirs += [str(pathlib.Path(d).resolve().relative_to(pkg_root)) for d in (spec.extra_include_dirs or [])]
json.dump({"files": inside, "include_dirs": sorted(set(include_dirs)), "lazy_modules": sorted(lazy),
           "pcie_referenced_modules": sorted(referenced),
           "sources": [str(pathlib.Path(s).resolve().relative_to(pkg_root)) for s in spec.sources]},
          out.open("w"), indent=1)
print(f"    {len(inside)} files ({sum(f.endswith('.py') for f in inside)} Python); the PCIe code imports "
      f"{len(referenced)} flashinfer modules, {len(lazy)} of them not already loaded by the import: "
      f"{', '.join(sorted(lazy)) or '-'}")
EOF

# The JIT links with -lcuda (the driver library). A CPU machine may have neither the driver nor the toolkit's stub
# (this one has none): then link the check's build against an empty stand-in. Only the build is checked here.
LDFLAGS_EXTRA=
if [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  mkdir -p "$TMP/stubs"
  echo 'void fipack_no_driver(void) {}' | cc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c - -o "$TMP/stubs/libcuda.so"
  LDFLAGS_EXTRA="-L$TMP/stubs"
  echo "    (no libcuda.so here: the check's build links against an empty stand-in, $TMP/stubs/libcuda.so)"
fi
check_env() {  # the isolated interpreter: python -S, only these on sys.path
  env -i PATH="$(dirname "$PY"):$CUDA_HOME/bin:/usr/bin:/bin" HOME="$TMP/home" CUDA_HOME="$CUDA_HOME" \
    FLASHINFER_EXTRA_LDFLAGS="$LDFLAGS_EXTRA" \
    PYTHONPATH="$1:$TMP/hostdeps:$TMP/farm" PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 \
    FLASHINFER_WORKSPACE_BASE="$TMP/ws" TVM_FFI_CACHE_DIR="$TMP/tvm-ffi-cache" \
    FLASHINFER_CUDA_ARCH_LIST="$CHECK_ARCHS" \
    "$PY" -S "${@:2}"
}

echo ">>> tracing what PcieIpcAllReduceWorkspace needs (full wheel, GPU-image packages only)"
check_env "$TMP/full" "$TMP/py/fipack_trace.py" "$TMP/full" "$TMP/manifest.json"

echo ">>> writing .fi/site and .fi/wheels"
rm -rf .fi/site .fi/wheels
mkdir -p .fi/site .fi/wheels
cat > "$TMP/py/fipack_copy.py" << 'EOF'
import hashlib, json, pathlib, shutil, sys
full, site, wheel = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
man = json.load(open(sys.argv[4]))
for rel in man["files"]:
    dst = site / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(full / rel, dst)
for rel in man["include_dirs"]:
    (site / rel).mkdir(parents=True, exist_ok=True)  # named by the spec; holds only what the build includes
# the wheel's metadata and licences, so importlib.metadata.version("flashinfer-python") answers 0.7.2; no RECORD:
# this is no pip install of the whole wheel
for p in full.glob("flashinfer_python-*.dist-info/**/*"):
    if p.is_file() and p.name != "RECORD":
        dst = site / p.relative_to(full)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst)
man["wheel"] = wheel.name
man["wheel_sha256"] = hashlib.sha256(wheel.read_bytes()).hexdigest()
man["note"] = "trimmed by scripts/pack_flashinfer_pcie.sh: only what flashinfer.comm.PcieIpcAllReduceWorkspace needs"
json.dump(man, (site / "flashinfer_pack_manifest.json").open("w"), indent=1)
EOF
"$PY" "$TMP/py/fipack_copy.py" "$TMP/full" .fi/site "$FI_WHEEL" "$TMP/manifest.json"
cp "$TMP"/gpu/*.whl .fi/wheels/
rm -rf "$TMP/full"  # from here on nothing of the full wheel is left to fall back on

echo ">>> checking .fi/site alone"
cat > "$TMP/py/fipack_check.py" << 'EOF'
import importlib, json, os, pathlib, sys
site = pathlib.Path(sys.argv[1]).resolve()
compile_it = sys.argv[2] == "1"
man = json.load(open(site / "flashinfer_pack_manifest.json"))
from flashinfer.comm import PcieIpcAllReduceWorkspace  # noqa: E402,F401
import flashinfer  # noqa: E402
import importlib.metadata  # noqa: E402
assert importlib.metadata.version("flashinfer-python") == flashinfer.__version__
assert pathlib.Path(flashinfer.__file__).resolve().is_relative_to(site), flashinfer.__file__
import tvm_ffi  # noqa: E402
print(f"    import OK: from flashinfer.comm import PcieIpcAllReduceWorkspace (flashinfer {flashinfer.__version__} "
      f"from {pathlib.Path(flashinfer.__file__).parent}, tvm-ffi {tvm_ffi.__version__})")
for name in man["pcie_referenced_modules"]:
    importlib.import_module(name)
print(f"    the {len(man['pcie_referenced_modules'])} flashinfer modules the PCIe code imports (also inside functions) "
      "import OK")
from flashinfer.jit.comm import gen_pcie_ipc_comm_module  # noqa: E402
from flashinfer.jit import cpp_ext  # noqa: E402
spec = gen_pcie_ipc_comm_module()
missing = []
for s in spec.sources:
    p = pathlib.Path(s).resolve()
    if not (p.is_file() and p.is_relative_to(site)):
        missing.append(f"source {p}")
dirs = cpp_ext.get_cccl_includes() + cpp_ext.get_system_includes(os.environ["CUDA_HOME"]) + list(
    spec.extra_include_dirs or [])
flashinfer_dirs = 0
for d in dirs:
    p = pathlib.Path(str(d)).resolve()
    if "flashinfer" in p.parts or p.is_relative_to(site):  # flashinfer's own (not Python's, CUDA's or tvm-ffi's)
        flashinfer_dirs += 1
        if not (p.is_dir() and p.is_relative_to(site)):
            missing.append(f"include dir {p}")
if missing:
    sys.exit("MISSING in .fi/site:\n  " + "\n  ".join(missing))
print(f"    JIT spec {spec.name!r}: {len(spec.sources)} source(s) and {flashinfer_dirs} flashinfer include dirs, "
      "all inside .fi/site")
if compile_it:
    import time
    t0 = time.time()
    spec.build(verbose=False)
    so = spec.jit_library_path
    assert so.is_file(), so
    print(f"    JIT build OK for {os.environ['FLASHINFER_CUDA_ARCH_LIST']}: {so.name}, {so.stat().st_size} bytes, "
          f"{time.time() - t0:.0f} s (nvcc + link only: loading it needs a GPU)")
EOF
COMPILE=1; [ "${SKIP_COMPILE:-0}" = 1 ] && COMPILE=0
check_env "$ROOT/.fi/site" "$TMP/py/fipack_check.py" "$ROOT/.fi/site" "$COMPILE"

echo ">>> done: $(du -sh .fi/site | cut -f1) in .fi/site ($(find .fi/site -type f | wc -l) files), $(du -sh .fi/wheels \
  | cut -f1) in .fi/wheels ($(ls .fi/wheels | tr '\n' ' ')); $(du -sb .fi | cut -f1) bytes in all"
