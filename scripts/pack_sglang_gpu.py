#!/usr/bin/env python3
"""Pack both supported SGLang releases for the GPU machine, small enough for the device tool's carry.

    python3 scripts/pack_sglang_gpu.py [--out .sgl] [--python-version 3.12] [--releases 0.5.23,0.5.13.post1]

The GPU machine has Python 3.12 and torch 2.11 but no package registry, and the device tool carries at most
64 MiB (working tree and carried paths together). The 0.5.23 wheel alone is 39 MB, the 0.5.13.post1 set of
the shared tools 40 MB. What this writes (gitignored, carry it as ".sgl"):

    .sgl/common/wheels/*.whl            deps the GPU image lacks, one version for both releases
    .sgl/<release>/sglang.tar.xz        the release's Python sources, trimmed (below)
    .sgl/<release>/wheels/*.whl         deps whose pinned version differs between the releases
    .sgl/MANIFEST.json                  what is where, sizes, and what was left out

Trimmed: every `.py` of the `sglang` package and the dist-info that `importlib.metadata` reads (the overlay
picks its seam table by version), minus `sglang/multimodal_gen`, `sglang/test`, `sglang/benchmark`, and every
non-Python file (the Rust extensions, 46 MB in 0.5.23, the CUDA/JIT sources and tuning JSONs: nothing the
distributed layer, the norms or the layer boundary import; the folders stay, empty). xz-compressed: about 6.2
and 2.8 MiB; with the wheels about 37 MiB in all.

Deps: what SGLang's modules import on the paths the GPU tests take (traced with CUDA faked on a CPU, stand-ins
for sgl_kernel/flashinfer, see benchmarks/harness/standins.py), minus what the GPU image already has
in a version that works (KINDS.md's list). Version pins that matter:
- 0.5.13.post1: transformers 5.8.1 (the image's 5.17 refuses SGLang's qwen3_asr config registration) with
  tokenizers 0.22.2 (5.8.1 wants <= 0.23.0), openai 2.6.1, apache-tvm-ffi 0.1.9, compressed-tensors 0.20.1;
- 0.5.23: apache-tvm-ffi 0.1.11, compressed-tensors 0.18.0; transformers is the image's 5.17 (0.5.23 pins
  5.19.0; what the tests import works with 5.17: checked on CPU by importing them), tokenizers the
  image's 0.23.2 (= 0.5.23's pin).
- jedi/parso (5 MB) are left out: `import IPython` (SGLang's `sglang.utils` imports IPython.display) does not
  import them.

On the GPU machine, per release (scripts/gpu_suite.sh does this in its sglang-shared stage):
    SITE=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE \
        .sgl/common/wheels/*.whl .sgl/0.5.23/wheels/*.whl
    python3 -c "import tarfile; tarfile.open('.sgl/0.5.23/sglang.tar.xz').extractall('$SITE')"
    export PYTHONPATH=$SITE:$PWD:$PWD/python

`--python-version 3.11` packs the same set for CPython 3.11 (to check it on a machine with torch 2.11 for
3.11, e.g. the 0.5.13.post1 CI venv); the default is the GPU machine's 3.12. Downloads are cached in
~/.cache/sglang-sm120-pack (outside the carry).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Deps that either release imports on the tested paths and that the GPU image lacks, where both releases take
# the same version (exact pins of requirements/<stack>/ci.txt); one copy serves both.
COMMON = [
    "annotated-types==0.8.0", "dill==0.4.1", "gguf==0.19.0", "loguru==0.7.3", "msgspec==0.23.0",
    "orjson==3.13.0", "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "sniffio==1.3.1",
    "starlette==1.10.0", "typing-inspection==0.4.5", "pyzmq==27.3.0", "setproctitle==1.3.8",
    # IPython (sglang.utils imports IPython.display) and what `import IPython` may reach, jedi/parso excepted
    "ipython==9.18.1", "traitlets==5.16.1", "decorator==5.3.1", "ipython-pygments-lexers==1.1.1",
    "matplotlib-inline==0.2.2", "pexpect==4.9.0", "ptyprocess==0.7.0", "prompt-toolkit==3.0.53",
    "wcwidth==0.9.4", "stack-data==0.6.3", "asttokens==3.0.2", "executing==2.3.0", "pure-eval==0.2.4",
    # server_args / entrypoints of 0.5.13.post1 import them; 0.5.23 too where its scheduler side is reached
    "distro==1.9.0", "partial-json-parser==0.2.1.1.post7", "jiter==0.19.0", "opentelemetry-api==1.45.2",
    "importlib-metadata==10.2.0", "interegular==0.3.3",
    # distributed/gated_launch (reached by 0.5.23's destroy_model_parallel) imports both at module level
    "fastapi==0.165.0", "uvicorn==0.54.0",
]

RELEASES = {
    "0.5.23": ["compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11", "openai==2.8.0"],
    "0.5.13.post1": [
        "compressed-tensors==0.20.1", "apache-tvm-ffi==0.1.9", "openai==2.6.1",
        "transformers==5.8.1", "tokenizers==0.22.2",
    ],
}

# Subtrees of the sglang package no GPU test imports (and that are large).
DROPPED_DIRS = ("sglang/multimodal_gen/", "sglang/test/", "sglang/benchmark/")
DIST_INFO_KEEP = ("METADATA", "WHEEL", "top_level.txt", "entry_points.txt")


def platform_args(python_version: str) -> list[str]:
    plats = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "any"]
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in plats:
        args += ["--platform", p]
    return args


def download(reqs: list[str], dest: Path, python_version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform_args(python_version),
           "-d", str(dest), *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        noise = "is ignored: it is neither a file nor a directory"
        err = "\n".join(line for line in done.stderr.splitlines() if noise not in line)
        raise SystemExit(f"pip download failed for {reqs}:\n{err}")


def wheel_for(req: str, folder: Path) -> Path:
    name, _, version = req.partition("==")
    stem = name.replace("-", "_").lower()
    hits = [p for p in folder.glob("*.whl")
            if p.name.lower().startswith(f"{stem}-{version}-".lower())]
    if len(hits) != 1:
        raise SystemExit(f"expected one wheel for {req} in {folder}, found {[p.name for p in hits]}")
    return hits[0]


def trim_sglang(wheel: Path, out: Path) -> dict:
    """sglang.tar.xz: the wheel's .py files (minus DROPPED_DIRS) and the dist-info metadata."""
    kept = dropped = kept_bytes = 0
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=9) as tf:
        # Every directory stays, empty where it held no .py: SGLang's JIT kernel packages check at import that
        # their `include/` and `csrc/` folders exist (they are read only when a kernel is compiled).
        dirs = sorted({name.rsplit("/", 1)[0] for name in zf.namelist()
                       if name.startswith("sglang/") and "/" in name and not name.startswith(DROPPED_DIRS)})
        for folder in sorted({"/".join(d.split("/")[:i]) for d in dirs for i in range(1, d.count("/") + 2)}):
            ti = tarfile.TarInfo(folder)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 0
            tf.addfile(ti)
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            name = info.filename
            if info.is_dir():
                continue
            top = name.split("/", 1)[0]
            if top.endswith(".dist-info"):
                keep = name.rsplit("/", 1)[-1] in DIST_INFO_KEEP and name.count("/") == 1
            else:
                keep = name.startswith("sglang/") and name.endswith(".py") and not name.startswith(DROPPED_DIRS)
            if not keep:
                dropped += 1
                continue
            data = zf.read(info)
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            tf.addfile(ti, io.BytesIO(data))
            kept += 1
            kept_bytes += len(data)
    return {"files_kept": kept, "files_dropped": dropped, "bytes_unpacked": kept_bytes,
            "dropped": list(DROPPED_DIRS) + ["every non-.py file (Rust extensions, CUDA sources, JSON configs)"]}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".sgl"))
    p.add_argument("--python-version", default="3.12", help="CPython of the target machine (GPU machine: 3.12)")
    p.add_argument("--releases", default=",".join(RELEASES), help=f"comma list of {', '.join(RELEASES)}")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/sglang-sm120-pack"))
    a = p.parse_args(argv)
    releases = [r for r in a.releases.split(",") if r]
    unknown = [r for r in releases if r not in RELEASES]
    if unknown:
        p.error(f"unknown release(s) {unknown}; known: {', '.join(RELEASES)}")
    out = Path(a.out)
    cache = Path(a.cache) / f"py{a.python_version}"
    manifest: dict = {"python_version": a.python_version, "releases": {}, "common": []}

    def place(reqs: list[str], dest: Path) -> list[dict]:
        download(reqs, cache, a.python_version)
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*.whl"):
            old.unlink()
        placed = []
        for req in reqs:
            src = wheel_for(req, cache)
            target = dest / src.name
            target.write_bytes(src.read_bytes())
            placed.append({"requirement": req, "wheel": src.name, "bytes": target.stat().st_size})
        return placed

    manifest["common"] = place(COMMON, out / "common" / "wheels")
    for release in releases:
        rdir = out / release
        download([f"sglang=={release}"], cache, a.python_version)
        rdir.mkdir(parents=True, exist_ok=True)
        trimmed = trim_sglang(wheel_for(f"sglang=={release}", cache), rdir / "sglang.tar.xz")
        deps = place(RELEASES[release], rdir / "wheels")
        manifest["releases"][release] = {"sglang": {"archive": "sglang.tar.xz",
                                                    "bytes": (rdir / "sglang.tar.xz").stat().st_size, **trimmed},
                                         "wheels": deps}
    manifest["total_bytes"] = du(out)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = du(out)
    for release in releases:
        print(f"{release}: sglang.tar.xz {manifest['releases'][release]['sglang']['bytes'] / 2**20:.1f} MiB, "
              f"wheels {du(out / release / 'wheels') / 2**20:.1f} MiB")
    print(f"common wheels {du(out / 'common') / 2**20:.1f} MiB; total {out}: {total / 2**20:.1f} MiB")
    if total > 55 * 2**20:
        print("WARNING: over 55 MiB: the device tool carries 64 MiB with the working tree", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
