"""The kernel library built ahead on a machine without a GPU for a GPU machine's image, carried to it instead of
compiled there (the in-place build takes one to two minutes of GPU-machine time on every fresh start).

  python3 scripts/device_lib.py build      (dev machine) a venv of the image's Python with the image's torch, and
                                           the kernels built in it for sm_90a into .device-lib/; carry ".device-lib"
  python3 scripts/device_lib.py install    (device machine, gpu_suite's build stage) the carried library put in
                                           place when it matches this checkout's kernel sources, this Python, this
                                           torch and the archs asked for, and loads; else exit 1 saying why, and
                                           the stage compiles as before
  python3 scripts/device_lib.py build --negative   also the negative-control builds (tests/gpu/negative_builds.py,
                                           about a minute each here) into .device-lib-negative/ (five libraries of
                                           about 8.5 MiB); carry it beside ".device-lib" for the negative,
                                           transports and tune stages
  python3 scripts/device_lib.py install-negative DIR   (gpu_suite's build stage) those libraries put in DIR when
                                           their record matches as the library's must; else exit 1 saying why, and
                                           the stages compile them there as before

The image's Python and torch: DEVICE_PYTHON and DEVICE_TORCH below. torch only imports
with its CUDA libraries present; the nvidia-* wheels hold no Python code, so the build venv borrows those of a
stack venv whose torch is the same release (`STACKS=sglang-0.5.13.post1 make venv` makes one) instead of
downloading them again.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".device-lib"
NEGATIVE_CARRY = ROOT / ".device-lib-negative"
RECORD = "record.json"
PACKAGE = "sgl_kernel_sm120"
DEVICE_PYTHON = "3.12"
DEVICE_TORCH = "2.11.0"
DEVICE_ARCHS = "9.0a"
BORROW_STACK = ROOT / ".venvs" / "sglang-0.5.13.post1"


def sources_digest(root: Path = ROOT) -> str:
    """What the library is compiled from: the CUDA/C++ sources, setup.py and the ABI naming it reads."""
    files = sorted(p for p in (root / "csrc").rglob("*") if p.is_file())
    files += [root / "setup.py", root / PACKAGE / "_abi.py"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def requested_archs(text: str) -> list[str]:
    return [a for a in text.replace(",", ";").replace(" ", ";").split(";") if a]


def mismatch(record: dict, *, digest: str, ext_suffix: str, torch_version: str, archs: list[str]) -> str | None:
    """Why a carried library must not be used here, or None when it may."""
    if record.get("sources") != digest:
        return f"it was built from other kernel sources ({record.get('sources')}, these are {digest})"
    if not str(record.get("library", "")).endswith(ext_suffix):
        return f"it was built for another Python ({record.get('library')}, this one loads *{ext_suffix})"
    if record.get("torch") != torch_version:
        return f"it was built against torch {record.get('torch')}, this is {torch_version}"
    missing = [a for a in archs if a not in record.get("archs", [])]
    if missing:
        return f"it holds code for {record.get('archs')}, not for {missing}"
    return None


def mismatch_here(record: dict, archs: str, root: Path = ROOT) -> str | None:
    """Why a carried record's builds must not be used by this checkout, Python and torch for `archs`, or None."""
    import torch

    return mismatch(record, digest=sources_digest(root), ext_suffix=sysconfig.get_config_var("EXT_SUFFIX"),
                    torch_version=torch.__version__, archs=requested_archs(archs))

def _python312() -> str:
    found = os.environ.get("DEVICE_PYTHON_BIN") or shutil.which(f"python{DEVICE_PYTHON}")
    candidates = [found] if found else []
    pyenv = os.path.expanduser(f"~/.pyenv/versions/{DEVICE_PYTHON}.*/bin/python{DEVICE_PYTHON}")
    candidates += sorted(glob.glob(pyenv))
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(f"no Python {DEVICE_PYTHON} here (set DEVICE_PYTHON_BIN): the device image's Python is "
                     f"{DEVICE_PYTHON}, and an extension only loads in the Python it was built for")


def _run(command: list, **kwargs) -> None:
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run(command, check=True, **kwargs)


def build(archs: str, borrow: Path = BORROW_STACK, negative: bool = False) -> None:
    borrowed = sorted(borrow.glob("lib/python3*/site-packages/nvidia"))
    if not borrowed:
        raise SystemExit(f"{borrow} has no nvidia-* libraries: run `STACKS={BORROW_STACK.name} make venv` first "
                         f"(its torch is {DEVICE_TORCH}, the device image's), or name such a venv with --borrow")
    venv = ROOT / "build" / f"device-py{DEVICE_PYTHON}"
    python = venv / "bin" / "python"
    if not python.exists():
        _run([_python312(), "-m", "venv", str(venv)])
    have = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if not have.stdout.startswith(DEVICE_TORCH):
        # --no-deps: the CUDA libraries are borrowed below; these are what `import torch` and the build need
        _run([python, "-m", "pip", "install", "--quiet", "--no-deps", f"torch=={DEVICE_TORCH}", "typing_extensions",
              "filelock", "sympy", "mpmath", "networkx", "jinja2", "MarkupSafe", "fsspec", "setuptools", "ninja"])
    shelf = venv / "borrowed"
    shelf.mkdir(exist_ok=True)
    link = shelf / "nvidia"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(borrowed[0])
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_borrowed_nvidia.pth").write_text(f"{shelf}\n")

    out = ROOT / "build" / "device-lib"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=archs, CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    _run([python, "setup.py", "build_ext", "--build-lib", str(out), "--build-temp", str(venv / "build-temp")],
         cwd=ROOT, env=env)
    libraries = sorted((out / PACKAGE).glob("_C_torch*.so"))
    if len(libraries) != 1:
        raise SystemExit(f"expected one library under {out / PACKAGE}, found {libraries}")
    library = libraries[0]
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True, check=True).stdout.strip()
    shutil.rmtree(CARRY, ignore_errors=True)
    CARRY.mkdir()
    for path in (out / PACKAGE).iterdir():
        shutil.copy2(path, CARRY / path.name)
    record = {"sources": sources_digest(), "library": library.name, "torch": torch_version,
              "archs": requested_archs(archs), "python": DEVICE_PYTHON}
    (CARRY / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    size_mib = library.stat().st_size / 2**20
    print(f">>> {CARRY.relative_to(ROOT)}/{library.name} ({size_mib:.1f} MiB) for Python {DEVICE_PYTHON}, torch "
          f"{torch_version}, {archs}: carry \".device-lib\"; gpu_suite's build stage puts it in place")
    if negative:
        build_negative(python, env)


def build_negative(python: Path, env: dict) -> None:
    """The negative-control libraries, built by the device venv's Python from the same sources as the library,
    under the library's record (its checks hold for them too)."""
    sys.path.insert(0, str(ROOT))
    from tests.gpu.negative_builds import ALL_FLAGS, build_broken

    work = ROOT / "build" / "device-negative"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(NEGATIVE_CARRY, ignore_errors=True)
    for flag in ALL_FLAGS:
        print(f"+ the negative-control build {flag}", flush=True)
        library = Path(build_broken(flag, str(work), python=str(python), env=env))
        (NEGATIVE_CARRY / library.parent.name).mkdir(parents=True)
        shutil.copy2(library, NEGATIVE_CARRY / library.parent.name / library.name)
    shutil.copy2(CARRY / RECORD, NEGATIVE_CARRY / RECORD)
    size_mib = sum(p.stat().st_size for p in NEGATIVE_CARRY.rglob("*.so")) / 2**20
    print(f">>> {NEGATIVE_CARRY.relative_to(ROOT)}: {len(ALL_FLAGS)} negative-control builds ({size_mib:.0f} MiB): "
          f"carry \"{NEGATIVE_CARRY.name}\" with \"{CARRY.name}\"")


def install(archs: str, root: Path = ROOT) -> int:
    """Puts the library carried in root/.device-lib into root's package when it may be used here; 0 when it is in
    place and loads from there, else 1 with the reason printed (nothing is left in place then)."""
    carry = root / CARRY.name
    record_path = carry / RECORD
    if not record_path.exists():
        print(f">>> no carried library ({CARRY.name}/{RECORD} missing): building here")
        return 1
    record = json.loads(record_path.read_text())
    why = mismatch_here(record, archs, root)
    if why:
        print(f">>> the carried library is not used: {why}; building here")
        return 1
    placed = [root / PACKAGE / path.name for path in carry.iterdir() if path.name != RECORD]
    for path in placed:
        shutil.copy2(carry / path.name, path)
    sys.path.insert(0, str(root))  # the kernel package's pure parts (no torch, no library loaded)
    from sgl_kernel_sm120.settings import VARIABLES, spellings

    # the library override under every spelling (SGLang 0.5.23 copies SGL_* to SGLANG_*)
    env = {k: v for k, v in os.environ.items() if k not in spellings(VARIABLES["library"])}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    probe = (f"from {PACKAGE} import _ext, policy; policy.kernel_limits(); print(_ext.library_path())")
    loads = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=root)
    loaded = loads.stdout.strip().splitlines()[-1:] if loads.returncode == 0 else []
    if not loaded or Path(loaded[0]).resolve() != (root / PACKAGE / record["library"]).resolve():
        for path in placed:
            path.unlink(missing_ok=True)
        said = loads.stderr.strip().splitlines()[-1:] or [f"another library loaded: {loaded}"]
        print(f">>> the carried library does not load here ({said[0]}); building here")
        return 1
    print(f">>> the carried library is in place ({record['library']}, {record['archs']}, sources {record['sources']})")
    return 0


def install_negative(archs: str, into: Path, root: Path = ROOT) -> int:
    """Copies the carried negative-control builds into `into` when their record matches this checkout, Python,
    torch and archs; 0 when they are there, else 1 with the reason printed (nothing copied)."""
    carry = root / NEGATIVE_CARRY.name
    if not (carry / RECORD).exists():
        print(f">>> no carried negative-control builds ({carry.name}/{RECORD} missing): they are compiled here")
        return 1
    why = mismatch_here(json.loads((carry / RECORD).read_text()), archs, root)
    if why:
        print(f">>> the carried negative-control builds are not used: {why}; they are compiled here")
        return 1
    shutil.copytree(carry, into, ignore=shutil.ignore_patterns(RECORD), dirs_exist_ok=True)
    print(f">>> the carried negative-control builds are in {into}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "install", "install-negative"])
    parser.add_argument("into", nargs="?", type=Path, help="install-negative: the folder the tests look in")
    parser.add_argument("--negative", action="store_true", help="build: the negative-control builds too")
    parser.add_argument("--archs", default=os.environ.get("TORCH_CUDA_ARCH_LIST") or DEVICE_ARCHS,
                        help="TORCH_CUDA_ARCH_LIST to build for, or to require (default: %(default)s)")
    parser.add_argument("--borrow", type=Path, default=BORROW_STACK,
                        help="build: a venv with torch %s's nvidia-* libraries (default: %%(default)s)" % DEVICE_TORCH)
    args = parser.parse_args(argv)
    if args.action == "build":
        build(args.archs, args.borrow, args.negative)
        return 0
    if args.action == "install-negative":
        if args.into is None:
            parser.error("install-negative needs the folder to put them in")
        return install_negative(args.archs, args.into)
    return install(args.archs)


if __name__ == "__main__":
    sys.exit(main())
