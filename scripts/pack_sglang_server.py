#!/usr/bin/env python3
"""Pack what a real `sglang.launch_server` needs on the GPU machine, within the device tool's carry.

    python3 scripts/pack_sglang_server.py [--release 0.5.13.post1|0.5.23|both] [--out .sgls] [--python-version 3.12]

Either release runs on the GPU machine's torch 2.11 with sglang-kernel 0.4.3 (built for torch 2.11): 0.5.13.post1
pins both; 0.5.23 pins sglang-kernel 0.4.10, whose library needs symbols torch 2.11 lacks, while every
sgl_kernel op its server path calls is in 0.4.3 with the same schema (the server test sets
SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1). What this writes per release (gitignored; carry ".sgls/<release>", one
release a device call: the two together pass the carry limit with the working tree):

    .sgls/<release>/sglang.tar.xz         every file of the sglang package but its one compiled extension
                                          (grpc `_core.so`, never imported on this path) and the multimodal-generation
                                          subtree; unlike the distributed-layer pack, the JIT kernels' CUDA
                                          sources, the Triton MoE configs, and `sglang/test` + `sglang/benchmark`
                                          (bench_one_batch_server lives there) stay
    .sgls/<release>/sgl_kernel.tar.xz     sglang-kernel 0.4.3's `sgl_kernel/` without the FA3 library
                                          (`flash_ops`, 1.07 GB: `--attention-backend triton` does not load it),
                                          `flashmla_ops` and `sm100/` (an H200 loads `sm90/common_ops`), and its
                                          dist-info
    .sgls/<release>/wheels/*.whl          what the server's import closure needs that the GPU image lacks
    .sgls/<release>/MANIFEST.json         what is where, sizes, and what was left out

The wheel list is the import closure of the launcher, HTTP server, tokenizer/detokenizer managers, scheduler,
model runner, DeepSeek-V3 and EAGLE-3 models, EAGLE worker, Triton attention backend, CUDA-graph runners,
sampler and `bench_one_batch_server` (traced on CPU with sgl_kernel and flashinfer stood in), minus the
packages the GPU image has (the device tool's KINDS.md list). flashinfer is not carried: SGLang imports it at
module import on CUDA, and the server test stands in for it (every call of a stand-in raises), with the
settings that keep SGLang off it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pack_sglang_gpu as base  # noqa: E402

ROOT = base.ROOT
RELEASES = tuple(base.RELEASES)
KERNEL = "sglang-kernel==0.4.3"

SERVER_EXTRAS = [
    # the HTTP server (request validation, forms) and what the audio/multimodal processors import at module level
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "python-multipart==0.0.34", "soundfile==0.13.1", "cffi==2.1.1", "pycparser==2.23",
    # bench_one_batch_server (its dataset helpers)
    "datasets==5.2.0", "multiprocess==0.70.19",
]
RELEASE_EXTRAS = {"0.5.13.post1": [], "0.5.23": ["xgrammar==0.2.7"]}


def server_wheels(release: str) -> list[str]:
    return sorted(set(base.COMMON + base.RELEASES[release] + SERVER_EXTRAS + RELEASE_EXTRAS[release]))

# sgl_kernel/ members left out: with --attention-backend triton none of them is loaded on an H200
KERNEL_DROPPED = ("sgl_kernel/flash_ops", "sgl_kernel/flashmla_ops", "sgl_kernel/sm100/")
SGLANG_DROPPED_SUFFIXES = (".so",)
# bench_one_batch_server and the gsm8k check README tells users to run live in sglang/test and sglang/benchmark
SGLANG_DROPPED_DIRS = ("sglang/multimodal_gen/",)


def _tar_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tf.addfile(info, io.BytesIO(data))


def pack_wheel_tree(wheel: Path, out: Path, keep) -> dict:
    """Write the members of `wheel` that keep(name) accepts into the xz tar `out` (sorted, fixed mtimes, so the
    same wheel gives the same archive). Returns counts and sizes."""
    kept = dropped = kept_bytes = 0
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=9) as tf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            if info.is_dir():
                continue
            if not keep(info.filename):
                dropped += 1
                continue
            data = zf.read(info)
            _tar_member(tf, info.filename, data)
            kept += 1
            kept_bytes += len(data)
    return {"files_kept": kept, "files_dropped": dropped, "bytes_unpacked": kept_bytes,
            "bytes": out.stat().st_size}


def keep_sglang(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return name.rsplit("/", 1)[-1] in base.DIST_INFO_KEEP and name.count("/") == 1
    return (name.startswith("sglang/") and not name.startswith(SGLANG_DROPPED_DIRS)
            and not name.endswith(SGLANG_DROPPED_SUFFIXES))


def keep_kernel(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return name.rsplit("/", 1)[-1] in base.DIST_INFO_KEEP and name.count("/") == 1
    return name.startswith("sgl_kernel/") and not name.startswith(KERNEL_DROPPED)


def pack(release: str, out: Path, cache: Path, python_version: str) -> dict:
    rdir = out / release
    rdir.mkdir(parents=True, exist_ok=True)
    base.download([f"sglang=={release}", KERNEL], cache, python_version)
    sglang = pack_wheel_tree(base.wheel_for(f"sglang=={release}", cache), rdir / "sglang.tar.xz", keep_sglang)
    kernel = pack_wheel_tree(base.wheel_for(KERNEL, cache), rdir / "sgl_kernel.tar.xz", keep_kernel)
    reqs = server_wheels(release)
    base.download(reqs, cache, python_version)
    wdir = rdir / "wheels"
    wdir.mkdir(exist_ok=True)
    for old in wdir.glob("*.whl"):
        old.unlink()
    wheels = []
    for req in reqs:
        src = base.wheel_for(req, cache)
        (wdir / src.name).write_bytes(src.read_bytes())
        wheels.append({"requirement": req, "wheel": src.name, "bytes": src.stat().st_size})
    manifest = {
        "python_version": python_version, "release": release,
        "sglang": {"archive": "sglang.tar.xz", **sglang,
                   "dropped": list(SGLANG_DROPPED_DIRS) + ["compiled extensions (*.so)"]},
        "sgl_kernel": {"requirement": KERNEL, "archive": "sgl_kernel.tar.xz", **kernel,
                       "dropped": list(KERNEL_DROPPED)},
        "wheels": wheels,
        "not_carried": {"flashinfer": "stood in by the server test (tests/gpu/server_patches.py)"},
    }
    (rdir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["total_bytes"] = base.du(rdir)
    (rdir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--release", default="both", choices=[*RELEASES, "both"])
    p.add_argument("--out", default=str(ROOT / ".sgls"))
    p.add_argument("--python-version", default="3.12", help="CPython of the target machine (GPU machine: 3.12)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/sglang-sm120-pack"))
    a = p.parse_args(argv)
    mib = 2 ** 20
    for release in RELEASES if a.release == "both" else (a.release,):
        m = pack(release, Path(a.out), Path(a.cache) / f"py{a.python_version}", a.python_version)
        print(f"{release}: sglang.tar.xz {m['sglang']['bytes'] / mib:.1f} MiB, sgl_kernel.tar.xz "
              f"{m['sgl_kernel']['bytes'] / mib:.1f} MiB, wheels {sum(w['bytes'] for w in m['wheels']) / mib:.1f} "
              f"MiB; carry .sgls/{release}: {m['total_bytes'] / mib:.1f} MiB")
        if m["total_bytes"] > 48 * mib:
            print(f"WARNING: .sgls/{release} is over 48 MiB: the device tool carries 64 MiB with the working tree",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
