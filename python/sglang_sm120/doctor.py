"""`python -m sglang_sm120.doctor`: can the sm120 all-reduce backend run on this machine, and if not, why?

Prints everything that decides it, from the settings, GPUs, P2P and topology through the gate, the byte bound, the
routing table and NCCL's own speed to a short multi-process self-test; exits 0 when the backend can run, 1
otherwise. `--report FILE` also writes it all, with the environment and the cached tables, as markdown for an issue.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import version

from sgl_kernel_sm120.policy import ELEMENT_BYTES
from sgl_kernel_sm120.settings import count, lookup, refuse, seconds

from . import nccl_check, seams
from .core import config
from .core.facts import gpu_uuid, kernel_error, key_facts
from .core.gate import SUPPORTED_WORLD_SIZES, decide
from .core.topology import cpu_affinity, format_levels, kernel_islands, probe
from .routing import cache, render
from .routing.table import make_key

NO_GPU_FIX = "check `nvidia-smi` (the NVIDIA driver must be >= 580, CUDA 13) and CUDA_VISIBLE_DEVICES"
PATHS = {"device": "sm120 kernels over CUDA IPC (P2P between every pair)",
         "host": "sm120 kernels over pinned host memory (no P2P needed)"}
DEFAULT_MAX_BS, DEFAULT_DRAFT_TOKENS = 32, 4
IOMMU_WORDS = ("iommu", "intel_iommu", "amd_iommu", "pcie_acs_override")


def section(title: str) -> None:
    print(f"\n== {title} ==")


def _run(cmd: Sequence[str], timeout: float = 20.0) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except Exception:  # not installed, or hung
        return None


def report_versions() -> None:
    section("software")
    print(f"python {platform.python_version()}, {platform.platform()}")
    try:
        import torch

        print(f"torch {torch.__version__}, CUDA (torch build) {torch.version.cuda}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else 'none'}")
    except ImportError:
        print("torch: not installed")
    except Exception as exc:
        print(f"NCCL: unknown ({exc})")
    try:
        print(f"sglang {version('sglang')}")
    except Exception:
        print("sglang: not installed")
    error = kernel_error()
    print("sgl_kernel_sm120 kernels: " + (f"available\n{build_record_line()}" if error is None else
                                          f"NOT available: {error}"))


def build_record_line() -> str:
    """Which GPU architectures the loaded library holds, and what built it (setup.py writes <module>.build.json
    beside every library it builds)."""
    try:
        from sgl_kernel_sm120 import _ext

        path = os.path.splitext(_ext.library_path())[0].split(".cpython")[0] + ".build.json"
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError) as exc:
        return f"sgl_kernel_sm120 build: no record ({exc})"
    except Exception as exc:
        return f"sgl_kernel_sm120 build: unknown ({type(exc).__name__}: {exc})"
    return (f"sgl_kernel_sm120 built for {';'.join(record.get('archs') or []) or '?'} with nvcc "
            f"{record.get('nvcc_release') or '?'} against torch {record.get('torch', '?')}")


def gpus() -> list[dict]:
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        return [{"index": i, "name": p.name, "capability": (p.major, p.minor), "uuid": gpu_uuid(p),
                 "memory_gib": p.total_memory / 2**30} for i, p in enumerate(props)]
    except Exception:
        return []


def p2p_matrix(count: int) -> list[list[bool]]:
    import torch

    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)] for i in range(count)]


def iommu_acs_hints() -> list[str]:
    hints = []
    with contextlib.suppress(OSError), open("/proc/cmdline") as handle:
        words = [w for w in handle.read().split() if w.split("=")[0].lower() in IOMMU_WORDS]
        print(f"kernel command line, IOMMU/ACS parameters: {' '.join(words) or 'none'}")
        if "iommu=pt" in words:
            hints.append("IOMMU in passthrough mode (iommu=pt): good for P2P")
        elif any(w in words for w in ("intel_iommu=on", "amd_iommu=on")):
            hints.append("IOMMU on in translated mode: P2P may fail or be slow; consider iommu=pt")
    groups = glob.glob("/sys/kernel/iommu_groups/*")
    print(f"IOMMU groups: {len(groups)}" + (" (IOMMU active)" if groups else " (IOMMU off or not visible)"))
    lspci = _run(["lspci", "-vvv"])
    if lspci is None:
        print("lspci: not available (install pciutils; run as root to see ACS control bits)")
        return hints
    acs = [line.strip() for line in lspci.splitlines() if "ACSCtl:" in line]
    redirect = [line for line in acs if "ReqRedir+" in line or "CmpltRedir+" in line or "SrcValid+" in line]
    print(f"ACS: {len(acs)} bridges report ACSCtl, {len(redirect)} with redirection/validation on"
          + ("" if acs else " (no ACSCtl lines: not root, or no ACS-capable bridges)"))
    if redirect:
        hints.append(f"ACS redirection is on at {len(redirect)} PCIe bridges: P2P writes detour through the root "
                     "complex (slow) or fail; disable ACS in the BIOS or with setpci for the GPU bridges")
    return hints


def dispatch_table(hidden: int, bound: config.ByteBound, *, assumed: str = "", table_shown: bool = True) -> None:
    print(f"bound: {bound.max_bytes} B ({bound.explanation})")
    if assumed:
        print(f"  {assumed}: this tool's defaults, not your server's: a server's rows are its largest captured "
              "batch times --speculative-num-draft-tokens; --max-bs, --draft-tokens or --max-bytes change them here")
    max_tokens = bound.max_bytes // (hidden * ELEMENT_BYTES)
    print(f"{'tokens':>8} {'bytes':>10}  backend (plain all-reduce / fused all-reduce+add+RMSNorm)")
    for tokens in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        backend = "by the routing table (sm120 or NCCL)" if tokens <= max_tokens else "NCCL / NCCL + norm (upstream)"
        print(f"{tokens:>8} {tokens * hidden * ELEMENT_BYTES:>10}  {backend}")
    print("within the bound, this box's routing table decides each size"
          + (" (section 'routing table')" if table_shown else " (measured with GPUs: `python -m sglang_sm120.tune`)")
          + "; without a usable table every size stays on NCCL")


def report_cluster_launch(found: list[dict]) -> None:
    """Whether the fused kernel's cluster launch works on each GPU (sgl_kernel_sm120.cluster_check runs it in a
    child process and caches the verdict, so a server start after the doctor pays nothing)."""
    try:
        from sgl_kernel_sm120 import _ext, cluster_check
        from sgl_kernel_sm120.settings import read

        ops, library = _ext.ops(), _ext.library_path()
    except Exception as exc:
        print(f"not checked: {exc}")
        return
    for gpu in found:
        try:
            capacity = [int(c) for c in ops.cluster_capacity_for(gpu["index"], 8)]
            verdict = (cluster_check.verdict_for(gpu["index"], gpu["uuid"], library, read()) if any(capacity) else
                       cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked"))
        except Exception as exc:
            print(f"cuda:{gpu['index']}: not checked ({type(exc).__name__}: {exc})")
            continue
        print(f"cuda:{gpu['index']}: co-resident clusters of 2/4/8 CTAs: {capacity}; check ({verdict.source}): "
              f"{verdict.reason} -> fused one-shot: "
              + ("row over a cluster" if verdict.ok else "one CTA per row (same bits, slower at a few rows)"))


def report_host_memory_need(world: int, bound: config.ByteBound) -> None:
    from sgl_kernel_sm120.construction import SHM_ADVICE, shm_room
    from sgl_kernel_sm120.policy import Memory, kernel_limits, oneshot_max_numel
    from sgl_kernel_sm120.settings import read

    folder = read().shm_dir
    try:
        from sgl_kernel_sm120 import _ext

        grain = kernel_limits().elems_per_pack
        max_numel = bound.max_bytes // ELEMENT_BYTES // grain * grain
        need, free = shm_room(_ext.ops(), world, max_numel,
                              oneshot_max_numel(world, Memory.HOST, max_numel, kernel_limits()), folder)
    except Exception as exc:
        print(f"host-memory workspace at TP={world}: size unknown ({exc})")
        return
    print(f"host-memory workspace at TP={world}, bound {bound.max_bytes} B: needs {need / 2**20:.1f} MiB in {folder} "
          f"(SGLANG_SM120_SHM_DIR), {free / 2**20:.1f} MiB free: "
          + ("fits" if free >= need else f"DOES NOT FIT: {SHM_ADVICE}"))


def report_routing_table(world: int, memory: str, matrix: list[list[bool]], uuids: list[str], hidden: int) -> None:
    """The table a TP=world server on cuda:0..world-1 would route by (its key as the server computes it, less
    the launch facts of a workspace the doctor does not build: the table's own are shown), or why there is none."""
    try:
        import torch

        islands = kernel_islands(probe(uuids[:world]).islands(), world) if memory == "device" else None
        key = make_key([key_facts(torch.device("cuda", i)) for i in range(world)], islands=islands,
                       p2p=[row[:world] for row in matrix[:world]], memory=memory)
    except Exception as exc:
        print(f"the table key could not be computed: {type(exc).__name__}: {exc}")
        return
    stored = cache.load_file(cache.table_path(key, hidden))
    launch = stored.table.key.get("launch") if stored.ok else None
    loaded = cache.load({**key, "launch": launch}, hidden=hidden, dtype="bfloat16")
    if loaded.ok:
        print(f"TP={world}, hidden {hidden}, bf16: tuned table {loaded.path}, measured {loaded.table.measured}, "
              f"with the workspace launching {launch} (a server whose workspace launches otherwise does not use it)")
        print(render.ranges_markdown(loaded.table))
    else:
        print(f"TP={world}, hidden {hidden}: {loaded.describe()}; a launch with --sm120-allreduce-tune auto measures "
              f"one before its ranks start (`python -m sglang_sm120.tune --hidden {hidden} --tp {world}` does it "
              "now); without a table every size goes to NCCL (--sm120-allreduce-tune off: the unmeasured seeds)")
    for other in cache.find_tables():
        if other.path != loaded.path:
            print(f"also in the cache: {other.path}: "
                  + (f"measured {other.table.measured}" if other.table else f"{other.status} ({other.reason})"))


def self_test(world: int, hidden: int, timeout_s: float, memory: str = "device") -> str | None:
    """The kernels over `world` local GPUs in spawned processes, the workspace in `memory`: None when exact."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_self_test_rank, args=(r, world, port, hidden, queue, memory)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    with contextlib.suppress(Exception):  # queue.Empty: the ranks still missing are named below
        for _ in range(world):
            results.update([queue.get(timeout=timeout_s)])
    for proc in procs:
        proc.join(timeout=5)
        proc.kill()  # nothing once it ended
    missing = [r for r in range(world) if r not in results]
    if missing:
        return f"self-test: ranks {missing} gave no result within {timeout_s:.0f}s"
    failed = "; ".join(f"rank {r}: {e}" for r, e in sorted(results.items()) if e)
    return f"self-test failed: {failed}" if failed else None


def _self_test_rank(rank: int, world: int, port: int, hidden: int, queue, memory: str) -> None:
    error = None
    try:
        import torch
        import torch.distributed as dist

        from sgl_kernel_sm120 import IpcAllReduce, reference_all_reduce, reference_all_reduce_add_rmsnorm

        torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        device = torch.device("cuda", rank)
        ar = IpcAllReduce(dist.group.WORLD, device, 64 * hidden, torch.bfloat16, memory=memory)

        def ints(shape, seed):  # small integers: every sum is exact in bf16
            return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)

        try:
            for rows in (1, 3, 16):
                inputs = [ints((rows, hidden), 100 * r + rows) for r in range(world)]
                if not torch.equal(ar.all_reduce(inputs[rank].to(device)).cpu(), reference_all_reduce(inputs)):
                    raise AssertionError(f"all_reduce rows={rows} differs from the exact sum")
                residual, weight = ints((rows, hidden), 7 + rows), torch.ones(hidden, dtype=torch.bfloat16)
                norm, res = ar.all_reduce_add_rmsnorm(inputs[rank].to(device), residual.to(device), weight.to(device),
                                                      1e-6)
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


def diagnose(args, settings: config.OverlaySettings) -> list[str]:
    """Every section; the problems that keep the backend from running."""
    mode = args.mode or settings.mode
    source = "--mode" if args.mode else f"${spelled[0]}" if (spelled := lookup(config.MODE_ENV)) else "default"
    print(f"mode: {mode} (from {source}); "
          f"tune at launch: {settings.tune}; host-memory workspace where P2P is missing: {settings.hostmem}")
    release, unset = seams.set_server_nccl()  # NCCL's check and the table key below, as a server's
    if unset:
        print(f"NCCL as an SGLang {release} server runs it: {unset}")
    report_versions()
    section("GPUs")
    found = gpus()
    if not found:
        print(f"no CUDA GPUs visible to torch: {NO_GPU_FIX}")
    for gpu in found:
        print(f"cuda:{gpu['index']} {gpu['name']} capability {gpu['capability'][0]}.{gpu['capability'][1]} "
              f"{gpu['memory_gib']:.0f} GiB {gpu['uuid']} cpus={cpu_affinity(gpu['uuid']) or '?'}")
    section("IOMMU / ACS")
    for hint in iommu_acs_hints():
        print(f"hint: {hint}")
    section("dispatch by message size (bf16)")
    explicit = args.max_bytes if args.max_bytes is not None else settings.max_bytes
    bound = config.resolve_max_bytes(explicit, argparse.Namespace(
        cuda_graph_max_bs=args.max_bs, cuda_graph_bs=None, speculative_num_draft_tokens=args.draft_tokens,
        speculative_algorithm="EAGLE3"), args.hidden, ELEMENT_BYTES)
    defaults = [f"{flag} {value}" for flag, value, default in (("--max-bs", args.max_bs, DEFAULT_MAX_BS),
                ("--draft-tokens", args.draft_tokens, DEFAULT_DRAFT_TOKENS)) if value == default]
    dispatch_table(args.hidden, bound, assumed=f"assumed {args.max_bs} x {args.draft_tokens} rows ("
                   f"{', '.join(defaults)})" if explicit is None and defaults else "", table_shown=bool(found))
    if not found:
        return [f"no CUDA GPUs: {NO_GPU_FIX}"]

    count, uuids, problems = len(found), [g["uuid"] for g in found], []
    section("CUDA P2P access (cudaDeviceCanAccessPeer)")
    matrix = p2p_matrix(count)
    print("      " + "".join(f"{j:>4}" for j in range(count)))
    for i, row in enumerate(matrix):
        print(f"{i:>6}" + "".join(f"{'X' if i == j else 'ok' if ok else 'NO':>4}" for j, ok in enumerate(row)))
    section("PCIe / NUMA topology (NVML) and islands")
    topo = probe(uuids)
    if topo.error:
        print(f"topology: {topo.error}")
    print(format_levels(topo.levels, [f"cuda:{g['index']}" for g in found]))
    islands = topo.islands()
    print(f"NUMA nodes: {topo.numa_nodes}; NVLink between all pairs: {topo.nvlink_all_pairs} -> link={topo.link}; "
          f"islands: {islands or 'flat'} (the 8-rank kernel uses {kernel_islands(islands, count) or 'flat'})")

    section(f"gate (mode={mode})")
    evaluated = "auto" if mode == "off" else mode
    if mode == "off":
        print("mode off: the overlay leaves SGLang untouched; with mode auto it would be:")
        problems.append("mode off: the sm120 backend is switched off")
    usable, worlds = None, [w for w in SUPPORTED_WORLD_SIZES if w <= count]
    for world in worlds:
        decision = decide(evaluated, [g["capability"] for g in found[:world]], world, 1,
                          [row[:world] for row in matrix[:world]], False, kernel_errors=[kernel_error()] * world,
                          names=[g["name"] for g in found[:world]], hostmem=settings.hostmem)
        path = PATHS.get(decision.memory, decision.memory) if decision.enabled else "NCCL (SGLang's own all-reduce)"
        print(f"TP={world} over cuda:0-{world - 1}: {'ENABLED' if decision.enabled else 'DISABLED'}, path: {path}: "
              f"{decision.reason}")
        if decision.enabled and mode != "off":
            usable = (world, decision.memory)
    if worlds and not decision.enabled:
        problems.append(f"TP={worlds[-1]}: {decision.reason}")
    if count < 2:
        problems.append("fewer than 2 GPUs: nothing to all-reduce across")

    section("routing table (python -m sglang_sm120.tune)")
    if usable is not None:
        report_routing_table(*usable, matrix, uuids, args.hidden)
    else:
        print("no TP size enables the backend here: nothing to route")
    if not args.no_nccl_check:
        section("NCCL at the verify sizes (it serves what the kernels do not, and is what the tune beats)")
        print("\n".join(nccl_check.report_lines(nccl_check.run(hidden=args.hidden, vocab=args.vocab,
                                                              timeout_s=args.nccl_timeout))))
    section("fused one-shot: cluster launch")
    report_cluster_launch(found)
    section("pinned host-memory workspace (GPUs without P2P)")
    report_host_memory_need(usable[0] if usable else min(count, 8) if count >= 2 else 2, bound)
    if usable is not None and not args.no_self_test:
        world, memory = usable
        section(f"self-test over {world} GPUs ({PATHS[memory]})")
        error = self_test(world, args.hidden, args.self_test_timeout, memory)
        if error and memory == "device" and settings.hostmem == "auto" and "IpcAllReduceProbeError" in error:
            print(f"{error}\nthe P2P data-path probe failed; retrying as a server would: {PATHS['host']}")
            error = self_test(world, args.hidden, args.self_test_timeout, "host")
        print("PASSED" if error is None else error)
        if error:
            problems.append(error)
    return problems


def write_report(path: str, output: str) -> str:
    """The doctor's output, the environment and the cached routing tables as one markdown file; the host name
    is replaced by <host>."""
    host = socket.gethostname()
    env = "\n".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                    if k.startswith(("SGLANG_SM120_", "SGL_SM120_", "NCCL_", "CUDA_VISIBLE_DEVICES")))
    parts = ["# sglang-sm120 doctor report", "", "```", output.rstrip(), "```", "", "## Environment", "",
             "```", env or "(none of SGLANG_SM120_*, SGL_SM120_*, NCCL_*, CUDA_VISIBLE_DEVICES set)", "```", "",
             "## nvidia-smi topo -m", "", "```", (_run(["nvidia-smi", "topo", "-m"]) or "(not available)").rstrip(),
             "```"]
    for loaded in cache.find_tables():
        parts += ["", render.table_markdown(loaded.table, path=loaded.path) if loaded.table else
                  f"### {loaded.path}\n\n{loaded.status}: {loaded.reason}"]
    text = "\n".join(parts) + "\n"
    if host:
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", "<host>", text)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return os.path.abspath(path)


def report_file(name: str, raw: str) -> str:
    """--report's FILE, checked before the run (which takes minutes): a file this user can write, new or not."""
    path = os.path.abspath(os.path.expanduser(raw))
    writable = os.access(path, os.W_OK) if os.path.exists(path) else os.access(os.path.dirname(path), os.W_OK | os.X_OK)
    if os.path.isdir(path) or not writable:
        raise refuse(name, raw, "a file this user can write, in a folder that exists")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", action=config.SettingAction, parse=config.parse_mode, default=None,
                        metavar="{" + ",".join(config.MODES) + "}", help="gate mode to evaluate (default: the setting)")

    def number(flag, parse, default, text):
        parser.add_argument(flag, action=config.SettingAction, parse=parse, default=default, help=text)

    number("--hidden", count(1), 7168, "the model's hidden size (Kimi-K2.5: 7168)")
    number("--max-bs", count(1), DEFAULT_MAX_BS, "a server's largest captured batch")
    number("--draft-tokens", count(1), DEFAULT_DRAFT_TOKENS, "a server's --speculative-num-draft-tokens")
    parser.add_argument("--max-bytes", action=config.SettingAction, parse=config.parse_max_bytes, default=None,
                        help="an explicit bound (as --sm120-allreduce-max-bytes)")
    number("--vocab", count(1), 163840, "the model's vocabulary (the logits all-gather)")
    parser.add_argument("--no-nccl-check", action="store_true", help="skip timing NCCL itself")
    number("--nccl-timeout", seconds(), 300.0, "seconds for the NCCL check")
    parser.add_argument("--no-self-test", action="store_true", help="skip the multi-process kernel self-test")
    number("--self-test-timeout", seconds(), 120.0, "seconds")
    parser.add_argument("--report", metavar="FILE", action=config.SettingAction, parse=report_file,
                        help="also write everything as markdown to FILE, for an issue")
    args = parser.parse_args(argv)
    output = _Tee(sys.stdout)
    with contextlib.redirect_stdout(output):
        try:
            problems = diagnose(args, config.settings_from_environment())
        except config.SettingError as exc:  # as a launch would stop: one line, no traceback
            print(f"setting error: {exc}")
            problems = [str(exc)]
        section("result")
        print("\n".join(f"cannot run: {p}" for p in problems) or "the sm120 all-reduce backend can run here")
    if args.report:
        try:
            print(f"report written to {write_report(args.report, output.getvalue())}")
        except OSError as exc:  # checked before the run, so only what changed since: a full disk, a removed folder
            print(f"report not written: {exc}")
            return 1
    return 1 if problems else 0


class _Tee(io.StringIO):
    """Keeps the output for --report and passes it on as it comes: the NCCL check and the self-test take minutes."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def write(self, text):
        self.out.write(text)
        return super().write(text)

    def flush(self):
        self.out.flush()


if __name__ == "__main__":
    sys.exit(main())
