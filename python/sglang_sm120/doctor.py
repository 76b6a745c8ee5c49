"""`python -m sglang_sm120.doctor`: can the sm120 all-reduce backend run on this machine, and if not, why?

Prints the GPUs (capability, driver, CUDA, NCCL), the architectures the kernels were built for, the probed
CUDA P2P matrix, the PCIe/NUMA topology and the islands the kernel would use, IOMMU/ACS hints, NCCL settings
worth setting for the large reductions that stay on NCCL, which backend each message size takes, which path the
TP group gets on this box (CUDA IPC over P2P, pinned host memory without P2P, or NCCL) and why, the routing table
measured on this box (python -m sglang_sm120.tune) if any, the P2P fingerprints (SM store vs load bandwidth per
pair and with all peers at once, one-way flag latency, driver-staged P2P; measured in a child process, not yet
run on a GPU), and (with GPUs and built kernels) a short multi-process self-test over that path. Exits 0 when
the backend can run, 1 otherwise, naming the reason. Works on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence

from .core import config
from .core.facts import gpu_uuid, kernel_error, key_facts
from .core.gate import SUPPORTED_WORLD_SIZES, GateDecision, decide
from .core.topology import cpu_affinity, format_levels, kernel_islands, level_name, probe
from .reporting import render
from .routing import cache
from .routing.table import make_key
from .tuning import fabric

NCCL_SETTINGS = [
    ("NCCL_P2P_LEVEL", "SYS", "let NCCL use P2P across the CPU interconnect too (large reductions stay on NCCL)"),
    ("NCCL_P2P_DISABLE", "0 / unset", "P2P must stay enabled"),
    ("NCCL_IB_DISABLE", "1", "single node: skip InfiniBand probing"),
    ("NCCL_CUMEM_ENABLE", "unset", "leave NCCL's cuMem allocator at its default"),
    ("NCCL_ALGO", "unset", "let NCCL tune (Ring for large messages on PCIe)"),
    ("NCCL_PROTO", "unset", "let NCCL tune"),
    ("NCCL_MIN_NCHANNELS", "unset or 8-16", "more channels help large PCIe reductions"),
]


def section(title: str) -> None:
    print(f"\n== {title} ==")


def _run(cmd: Sequence[str], timeout: float = 20.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except Exception:
        return None
    return done.stdout


def report_versions() -> None:
    section("software")
    print(f"host {socket.gethostname()}, python {platform.python_version()}, {platform.platform()}")
    try:
        import torch

        print(f"torch {torch.__version__}, CUDA (torch build) {torch.version.cuda}")
        try:
            nccl = torch.cuda.nccl.version()
            print("NCCL " + ".".join(map(str, nccl)) if isinstance(nccl, tuple) else f"NCCL {nccl}")
        except Exception:
            print("NCCL: unknown")
    except ImportError:
        print("torch: not installed")
    try:
        from importlib.metadata import version

        print(f"sglang {version('sglang')}")
    except Exception:
        print("sglang: not installed")
    error = kernel_error()
    print("sgl_kernel_sm120 kernels: " + ("available" if error is None else f"NOT available: {error}"))
    if error is None:
        print(build_record_line())
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda_driver = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        pynvml.nvmlShutdown()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        print(f"driver {driver}, CUDA driver API {cuda_driver // 1000}.{cuda_driver % 1000 // 10}")
    except Exception as exc:
        print(f"driver: unknown (NVML: {type(exc).__name__}: {exc})")


# setup.py writes <module>.build.json beside every library it builds (pip hides the build's own output).
BUILD_RECORD_SUFFIX = ".build.json"


def kernel_build_record() -> tuple[str, dict | None]:
    """Where the build record of the library this process loads is, and the record (None when there is none)."""
    from sgl_kernel_sm120 import _ext
    from sgl_kernel_sm120.env import setting

    override = setting(_ext.LIBRARY_OVERRIDE_ENV)
    if override:
        directory, module = os.path.dirname(override), os.path.basename(override).split(".", 1)[0]
    else:
        directory, module = _ext.PACKAGE_DIR, _ext.expected_module()
    path = os.path.join(directory, module + BUILD_RECORD_SUFFIX)
    try:
        with open(path, encoding="utf-8") as handle:
            return path, json.load(handle)
    except (OSError, ValueError):
        return path, None


def build_record_line() -> str:
    """Which GPU architectures the loaded library holds, and what built it."""
    try:
        path, record = kernel_build_record()
    except Exception as exc:
        return f"sgl_kernel_sm120 build: unknown ({type(exc).__name__}: {exc})"
    if record is None:
        return f"sgl_kernel_sm120 build: no record at {path} (built before the records, or not by setup.py)"
    archs = ";".join(record.get("archs") or []) or "?"
    return (f"sgl_kernel_sm120 built for {archs} with nvcc {record.get('nvcc_release') or '?'} against torch "
            f"{record.get('torch', '?')} ({path})")


def gpus() -> list[dict]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            out.append({
                "index": index,
                "name": props.name,
                "capability": (props.major, props.minor),
                "uuid": gpu_uuid(props),
                "memory_gib": props.total_memory / 2**30,
            })
        return out
    except Exception:
        return []


def p2p_matrix(count: int) -> list[list[bool]]:
    import torch

    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)] for i in range(count)]


def iommu_acs_hints() -> list[str]:
    hints = []
    try:
        with open("/proc/cmdline") as handle:
            cmdline = handle.read().strip()
        print(f"kernel cmdline: {cmdline}")
        if "iommu=pt" in cmdline:
            hints.append("IOMMU in passthrough mode (iommu=pt): good for P2P")
        elif "intel_iommu=on" in cmdline or "amd_iommu=on" in cmdline:
            hints.append("IOMMU on in translated mode: P2P may fail or be slow; consider iommu=pt")
    except OSError:
        pass
    groups = glob.glob("/sys/kernel/iommu_groups/*")
    print(f"IOMMU groups: {len(groups)}" + (" (IOMMU active)" if groups else " (IOMMU off or not visible)"))
    lspci = _run(["lspci", "-vvv"])
    if lspci is None:
        print("lspci: not available (install pciutils; run as root to see ACS control bits)")
    else:
        acs_lines = [line.strip() for line in lspci.splitlines() if "ACSCtl:" in line]
        redirect = [line for line in acs_lines if "ReqRedir+" in line or "CmpltRedir+" in line or "SrcValid+" in line]
        print(f"ACS: {len(acs_lines)} bridges report ACSCtl, {len(redirect)} with redirection/validation on")
        if redirect:
            hints.append(
                f"ACS redirection is on at {len(redirect)} PCIe bridges: P2P writes detour through the root complex "
                "(slow) or fail; disable ACS in the BIOS or with setpci for the GPU bridges"
            )
        elif not acs_lines:
            print("  (no ACSCtl lines: not root, or no ACS-capable bridges)")
    return hints


NO_GPU_FIX = "check `nvidia-smi` (the NVIDIA driver must be >= 580, CUDA 13) and CUDA_VISIBLE_DEVICES"
# How a server derives the rows of its bound (core/config.py derive_max_bytes), and what changes them.
SERVER_ROWS = ("a server's rows are its largest captured CUDA-graph batch (--cuda-graph-max-bs, or the largest of "
               "--cuda-graph-bs; SGLang 0.5.23 counts the batches it captures, clamped to its request pool) times "
               "--speculative-num-draft-tokens when a --speculative-algorithm is set")
BOUND_FLAGS = ("--max-bs and --draft-tokens change them here; --max-bytes here, or --sm120-allreduce-max-bytes or "
               f"${config.MAX_BYTES_ENV} on a server, sets the bound itself (a derived one is capped at "
               f"{config.DERIVED_MAX_BYTES_CAP} B)")


def dispatch_table(hidden: int, bound: config.ByteBound, element_size: int = 2, *, assumed: str = "") -> None:
    """The byte bound and which sizes it sends to the kernels. `assumed`: the batch and draft tokens the bound was
    derived from, when they are this tool's defaults rather than a server's settings."""
    print(f"bound: {bound.max_bytes} B ({bound.explanation})")
    if assumed:
        print(f"  {assumed}: this tool's defaults, not your server's; {SERVER_ROWS}; {BOUND_FLAGS}")
    max_tokens = bound.max_bytes // (hidden * element_size)
    print(f"{'tokens':>8} {'bytes':>10}  backend (plain all-reduce / fused all-reduce+add+RMSNorm)")
    for tokens in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        nbytes = tokens * hidden * element_size
        # within the bound nothing is ours yet: the table picks per size, and without one NCCL serves everything
        backend = "by the routing table (sm120 or NCCL)" if tokens <= max_tokens else "NCCL / NCCL + norm (upstream)"
        print(f"{tokens:>8} {nbytes:>10}  {backend}")
    print("within the bound, the routing table (below) decides each size: the sizes NCCL won stay on NCCL, and "
          "so does every size when no measured table can be used")


PATHS = {
    "device": "sm120 kernels over CUDA IPC (P2P between every pair)",
    "host": "sm120 kernels over pinned host memory (no P2P needed)",
}


def path_text(decision: GateDecision) -> str:
    """Which all-reduce path a gate decision gives a TP group, in the doctor's words."""
    if not decision.enabled:
        return "NCCL (SGLang's own all-reduce)"
    return PATHS.get(decision.memory, f"sm120 kernels, memory {decision.memory!r}")


def report_cluster_launch(found: list[dict]) -> None:
    """Whether the fused kernel's cluster launch works on each GPU: its capacity, and the verdict of the check
    that runs a cluster kernel in a child process (sgl_kernel_sm120.cluster_check; cached, so a server start
    after the doctor pays nothing)."""
    try:
        from sgl_kernel_sm120 import _ext, cluster_check

        ops = _ext.ops()
        library = _ext.library_path()
    except Exception as exc:
        print(f"not checked: {exc}")
        return
    for gpu in found:
        try:
            capacity = [int(c) for c in ops.cluster_capacity_for(gpu["index"], 8)]
            shown = ", ".join(f"{c} CTAs: {n}" for c, n in zip(cluster_check.CLUSTER_SIZES, capacity, strict=True))
            verdict = (cluster_check.verdict_for(gpu["index"], gpu["uuid"], library) if any(capacity) else
                       cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked"))
        except Exception as exc:
            print(f"cuda:{gpu['index']}: not checked ({type(exc).__name__}: {exc})")
            continue
        launch = "row over a cluster" if verdict.ok else "one CTA per row (same bits, slower at a few rows)"
        print(f"cuda:{gpu['index']}: co-resident clusters ({shown}); check ({verdict.source}): {verdict.reason} -> "
              f"fused one-shot: {launch}")


def report_host_memory_need(world: int, bound: config.ByteBound) -> None:
    """What the pinned host-memory workspace (no P2P) would take in its tmpfs at this bound, and what is free."""
    from sgl_kernel_sm120.construction import DEFAULT_SHM_DIR, SHM_DIR_ENV
    from sgl_kernel_sm120.env import setting
    from sgl_kernel_sm120.policy import ELEMENT_BYTES, Memory, kernel_limits, oneshot_max_numel

    folder = setting(SHM_DIR_ENV).strip() or DEFAULT_SHM_DIR
    try:
        from sgl_kernel_sm120 import _ext

        grain = kernel_limits().elems_per_pack
        max_numel = bound.max_bytes // ELEMENT_BYTES // grain * grain
        oneshot = oneshot_max_numel(world, Memory.HOST, max_numel, kernel_limits())
        need = int(_ext.ops().host_shared_bytes_for(world, max_numel, oneshot))
    except Exception as exc:
        print(f"host-memory workspace at TP={world}: size unknown ({exc})")
        return
    try:
        stat = os.statvfs(folder)
        free = stat.f_bavail * stat.f_frsize
        verdict = "fits" if free >= need else f"DOES NOT FIT: enlarge {folder} or set {SHM_DIR_ENV}"
        room = f"{folder} has {free / 2**20:.1f} MiB free: {verdict}"
    except OSError as exc:
        room = f"{folder}: {exc}"
    print(f"host-memory workspace at TP={world}, bound {bound.max_bytes} B: needs {need / 2**20:.1f} MiB in {folder} "
          f"({SHM_DIR_ENV}); {room}")


def report_routing_table(world: int, memory: str, matrix: list[list[bool]], uuids: list[str], hidden: int,
                         bound: config.ByteBound) -> None:
    """The routing table a TP=world server on cuda:0..world-1 would route by (the key the server computes), or why
    there is none; and the other tables in the cache folder."""
    try:
        import torch

        local = [key_facts(torch.device("cuda", i)) for i in range(world)]
        islands = None
        if memory == "device":
            islands = kernel_islands(probe(uuids[:world]).islands(), world)
        key = make_key(local, islands=islands, p2p=[row[:world] for row in matrix[:world]], memory=memory)
    except Exception as exc:
        print(f"the table key could not be computed: {type(exc).__name__}: {exc}")
        return
    # The key's launch facts (cluster sizes, SM budget, PDL) are a built workspace's, which the doctor does not
    # build: it takes the table's own and says that a server uses it only when its workspace launches alike.
    stored = cache.load_file(cache.table_path(key, hidden))
    launch = stored.table.key.get("launch") if stored.ok else None
    key = {**key, "launch": launch}
    rows = max(1, bound.max_bytes // (hidden * 2))
    loaded = cache.load(key, hidden=hidden, dtype="bfloat16", max_bytes=rows * hidden * 2)
    if loaded.ok:
        print(f"TP={world}, hidden {hidden}, bf16: tuned table {loaded.path}, measured {loaded.table.measured}")
        print(f"  measured with the workspace launching {launch}; a server whose workspace launches otherwise "
              "does not use it")
        print(render.ranges_markdown(loaded.table))
    elif loaded.status == cache.MISSING:
        print(f"TP={world}, hidden {hidden}: no table ({loaded.path}); a server measures a quick one at start "
              f"(--sm120-allreduce-tune auto) and, if that fails, sends every size to NCCL; "
              f"`python -m sglang_sm120.tune --hidden {hidden} --tp {world}` measures this box fully; "
              "--sm120-allreduce-tune off runs the unmeasured seeds")
    else:
        print(f"TP={world}, hidden {hidden}: {loaded.warning()}")
    others = [t for t in cache.find_tables() if t.path != loaded.path]
    for other in others:
        what = f"measured {other.table.measured}" if other.table is not None else f"{other.status} ({other.reason})"
        print(f"also in the cache: {other.path}: {what}")


FABRIC_MODULE = "sglang_sm120.tuning.fabric_probe"


def report_fingerprints(count: int, timeout_s: float) -> None:
    """The P2P fingerprints, measured in a child process (tuning/fabric_probe.py) so that a fault on an unknown
    fabric cannot end the doctor; judged by tuning/fabric.py."""
    command = [sys.executable, "-m", FABRIC_MODULE, "--gpus", ",".join(map(str, range(count)))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"not measured: the probe did not finish within {timeout_s:.0f} s")
        return
    except OSError as exc:
        print(f"not measured: the probe could not start ({exc})")
        return
    found = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not found:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-400:]
        print(f"not measured: the probe failed (exit code {done.returncode}): {tail}")
        return
    try:
        fingerprint = fabric.Fingerprint.from_dict(json.loads(found[-1]))
        for line in fabric.report_lines(fingerprint):
            print(line)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"not measured: the probe's answer could not be read ({type(exc).__name__}: {exc})")


def self_test(world: int, hidden: int, timeout_s: float, memory: str = "device") -> str | None:
    """Runs the kernels over `world` local GPUs in spawned processes, with the workspace in `memory`. None when
    it passed, else why not."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_self_test_worker, args=(rank, world, port, hidden, queue, memory))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world):
            rank, error = queue.get(timeout=timeout_s)
            results[rank] = error
    except Exception:
        pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    missing = [r for r in range(world) if r not in results]
    if missing:
        return f"self-test: ranks {missing} gave no result within {timeout_s:.0f}s"
    failed = {r: e for r, e in results.items() if e}
    if failed:
        return "self-test failed: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _self_test_worker(rank: int, world: int, port: int, hidden: int, queue, memory: str = "device") -> None:
    error = None
    try:
        import torch
        import torch.distributed as dist

        from sgl_kernel_sm120 import IpcAllReduce, reference_all_reduce, reference_all_reduce_add_rmsnorm

        torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        device = torch.device("cuda", rank)
        ar = IpcAllReduce(dist.group.WORLD, device, 64 * hidden, torch.bfloat16, memory=memory)
        try:
            for rows in (1, 3, 16):
                inputs = [_int_tensor((rows, hidden), seed=100 * r + rows) for r in range(world)]
                mine = inputs[rank].to(device)
                out = ar.all_reduce(mine)
                expect = reference_all_reduce(inputs).to(device)
                if not torch.equal(out, expect):
                    raise AssertionError(f"all_reduce rows={rows} differs from the exact sum")
                residual = _int_tensor((rows, hidden), seed=7 + rows)
                weight = torch.ones(hidden, dtype=torch.bfloat16)
                norm, res = ar.all_reduce_add_rmsnorm(mine, residual.to(device), weight.to(device), 1e-6)
                ref_norm, ref_res = reference_all_reduce_add_rmsnorm(inputs, residual, weight, 1e-6)
                if not torch.equal(res.cpu(), ref_res):
                    raise AssertionError(f"fused residual rows={rows} differs from the exact sum")
                if not torch.allclose(norm.float().cpu(), ref_norm.float(), atol=2e-2, rtol=2e-2):
                    raise AssertionError(f"fused norm rows={rows} differs from the reference")
            torch.cuda.synchronize(device)
        finally:
            ar.close()
        dist.destroy_process_group()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    queue.put((rank, error))


def _int_tensor(shape, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


# What the doctor assumes of a server when not told: a CUDA-graph batch of 32 with 4 EAGLE draft tokens.
DEFAULT_MAX_BS = 32
DEFAULT_DRAFT_TOKENS = 4


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.doctor", description=__doc__)
    parser.add_argument("--mode", action=config.SettingAction, parse=config.parse_mode,
                        metavar="{" + ",".join(config.MODES) + "}", default=None,
                        help=f"gate mode to evaluate (default: ${config.MODE_ENV} or auto)")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size for the dispatch table (Kimi-K2.5: 7168)")
    parser.add_argument("--max-bs", type=int, default=DEFAULT_MAX_BS,
                        help="largest CUDA-graph batch assumed for the bound (a server's --cuda-graph-max-bs)")
    parser.add_argument("--draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS,
                        help="EAGLE draft tokens assumed for the bound (a server's --speculative-num-draft-tokens)")
    parser.add_argument("--max-bytes", action=config.SettingAction, parse=config.parse_max_bytes, default=None,
                        help="explicit bound (overrides the derived one)")
    parser.add_argument("--no-self-test", action="store_true", help="skip the multi-process kernel self-test")
    parser.add_argument("--self-test-timeout", type=float, default=120.0)
    parser.add_argument("--no-fingerprint", action="store_true",
                        help="skip the P2P fingerprints (bandwidth, flag latency, driver staging)")
    parser.add_argument("--fingerprint-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    problems: list[str] = []
    try:
        # A bad SGLANG_SM120_* value would stop the server at launch: report it the same way, without a traceback.
        settings = config.settings_from_environment()
    except config.SettingError as exc:
        print(f"setting error: {exc}")
        return _finish([str(exc)])
    mode = args.mode or settings.mode
    mode_source = "--mode" if args.mode else (f"${config.MODE_ENV}" if os.environ.get(config.MODE_ENV) else "default")
    print(f"mode: {mode} (from {mode_source})")
    hostmem = settings.hostmem
    hostmem_source = f"${config.HOSTMEM_ENV}" if os.environ.get(config.HOSTMEM_ENV) else "default"
    print(f"host-memory workspace where P2P is missing: {hostmem} (from {hostmem_source})")

    report_versions()
    section("GPUs")
    found = gpus()
    if not found:
        print(f"no CUDA GPUs visible to torch: {NO_GPU_FIX}")
    for gpu in found:
        cap = gpu["capability"]
        print(f"cuda:{gpu['index']} {gpu['name']} capability {cap[0]}.{cap[1]} {gpu['memory_gib']:.0f} GiB "
              f"{gpu['uuid']} cpus={cpu_affinity(gpu['uuid']) or '?'}")

    section("IOMMU / ACS")
    hints = iommu_acs_hints()
    for hint in hints:
        print(f"hint: {hint}")

    section("NCCL settings for the reductions that stay on NCCL")
    for name, suggested, why in NCCL_SETTINGS:
        print(f"{name}={os.environ.get(name, '(unset)')}  suggested: {suggested}  ({why})")

    section("dispatch by message size (bf16)")
    explicit = args.max_bytes if args.max_bytes is not None else settings.max_bytes
    bound = config.resolve_max_bytes(
        explicit,
        argparse.Namespace(cuda_graph_max_bs=args.max_bs, cuda_graph_bs=None,
                           speculative_num_draft_tokens=args.draft_tokens, speculative_algorithm="EAGLE3"),
        args.hidden, 2,
    )
    defaults = [f"{name} {value}" for name, value, given in (
        ("--max-bs", args.max_bs, args.max_bs != DEFAULT_MAX_BS),
        ("--draft-tokens", args.draft_tokens, args.draft_tokens != DEFAULT_DRAFT_TOKENS)) if not given]
    assumed = ""
    if explicit is None and defaults:
        assumed = f"assumed {args.max_bs} x {args.draft_tokens} rows ({', '.join(defaults)})"
    dispatch_table(args.hidden, bound, assumed=assumed)

    if not found:
        problems.append(f"no CUDA GPUs: {NO_GPU_FIX}")
        return _finish(problems)

    count = len(found)
    section("CUDA P2P access (probed with cudaDeviceCanAccessPeer)")
    matrix = p2p_matrix(count)
    print("      " + "".join(f"{j:>4}" for j in range(count)))
    for i, row in enumerate(matrix):
        print(f"{i:>6}" + "".join(f"{('X' if i == j else ('ok' if ok else 'NO')):>4}" for j, ok in enumerate(row)))

    section("PCIe / NUMA topology (NVML) and islands")
    topo = probe([g["uuid"] for g in found])
    if topo.error:
        print(f"topology: {topo.error}")
    print(format_levels(topo.levels, [f"cuda:{g['index']}" for g in found]))
    numa = [f"cuda:{g['index']}={n if n is not None else '?'}" for g, n in zip(found, topo.numa_nodes, strict=False)]
    print("NUMA nodes: " + ", ".join(numa))
    print(f"NVLink between all pairs: {topo.nvlink_all_pairs} -> link={topo.link}")
    islands = topo.islands()
    print(f"islands (over all visible GPUs): {islands or 'flat'}; the 8-rank kernel uses "
          f"{kernel_islands(islands, count) or 'flat'}")
    if topo.levels:
        farthest = max((v for row in topo.levels for v in row if v is not None), default=None)
        print(f"farthest pair level: {level_name(farthest)}")

    section(f"gate (mode={mode})")
    kernels = kernel_error()
    usable_world, usable_memory, largest = None, "device", None
    # With mode off the server would not use the backend at all; still say what `auto` would do on this box.
    evaluated = "auto" if mode == "off" else mode
    if mode == "off":
        print("mode off: the overlay leaves SGLang untouched on every TP size; with mode auto it would be:")
        problems.append(f"mode off (from {mode_source}): the sm120 backend is switched off")
    for world in SUPPORTED_WORLD_SIZES:
        if world > count:
            continue
        sub = [row[:world] for row in matrix[:world]]
        decision = decide(evaluated, [g["capability"] for g in found[:world]], world, 1, sub, False,
                          kernel_errors=[kernels] * world, names=[g["name"] for g in found[:world]], hostmem=hostmem)
        print(f"TP={world} over cuda:0-{world - 1}: {'ENABLED' if decision.enabled else 'DISABLED'}, path: "
              f"{path_text(decision)}: {decision.reason}")
        largest = (world, decision)
        if decision.enabled:
            usable_world, usable_memory = world, decision.memory
        elif world == max(w for w in SUPPORTED_WORLD_SIZES if w <= count):
            problems.append(f"TP={world}: {decision.reason}")
    if count < 2:
        problems.append("fewer than 2 GPUs: nothing to all-reduce across")
    if largest is not None:
        world, decision = largest
        prefix = "with mode auto, " if mode == "off" else ""
        print(f"path on this box ({prefix}TP={world}): {path_text(decision)}")
        if decision.enabled and decision.memory == "device":
            print("  (the workspace also probes the P2P data path when it is built; if writes are dropped there, "
                  + ("the server retries in pinned host memory)" if hostmem == "auto" else
                     f"the server stays on NCCL: {config.HOSTMEM_ENV}=off)"))
    if mode == "off":
        usable_world = None

    section("routing table (python -m sglang_sm120.tune)")
    if usable_world is not None:
        report_routing_table(usable_world, usable_memory, matrix, [g["uuid"] for g in found], args.hidden, bound)
    else:
        print("no TP size enables the backend here: nothing to route")
    if count >= 2 and not args.no_fingerprint:
        section("P2P fingerprints: SM store vs load, flag latency, driver staging (not yet validated on a GPU)")
        report_fingerprints(count, args.fingerprint_timeout)

    section("fused one-shot: cluster launch")
    report_cluster_launch(found)
    section("pinned host-memory workspace (GPUs without P2P)")
    report_host_memory_need(largest[0] if largest is not None else 2, bound)

    if usable_world is not None and not args.no_self_test:
        section(f"self-test over {usable_world} GPUs ({path_text(GateDecision(True, '', usable_memory))})")
        error = self_test(usable_world, args.hidden, args.self_test_timeout, usable_memory)
        if error and usable_memory == "device" and hostmem == "auto" and "IpcAllReduceProbeError" in error:
            # What the server does: a failed P2P data-path probe sends the workspace to host memory.
            print(error)
            print(f"the P2P data-path probe failed; retrying as the server would: {PATHS['host']}")
            error = self_test(usable_world, args.hidden, args.self_test_timeout, "host")
            if error is None:
                print(f"path on this box (TP={usable_world}): {PATHS['host']}, after the P2P data-path probe failed")
        print("PASSED" if error is None else error)
        if error:
            problems.append(error)
    return _finish(problems)


def _finish(problems: list[str]) -> int:
    section("result")
    if problems:
        for problem in problems:
            print(f"cannot run: {problem}")
        return 1
    print("the sm120 all-reduce backend can run here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
