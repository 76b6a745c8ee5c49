#!/usr/bin/env python3
"""All-reduce latency sweep, ours side by side with its peers, every number from CUDA-graph replays.

    torchrun --nproc-per-node N benchmarks/bench_allreduce.py [--sizes 1K,64K,...] [--rows 1,3,...] [--quick]
                                                              [--impls nccl,sm120,...] [--out benchmarks/results]

Shapes: flat bf16 tensors of 1 KB .. 64 MB (powers of two), and Kimi-K2.5 hidden states [rows, 7168] bf16.
Ops: ``allreduce`` on every shape; ``allreduce_add_rmsnorm`` on the [rows, hidden] shapes (ours: the fused
kernel; every other implementation: its all-reduce followed by one fused add+RMSNorm kernel).
Implementations: nccl (torch.distributed), sm120 (ours: the dispatch's choice and every forced variant),
torch_symm_mem (one-shot), sglang_car_v2 (SGLang's CustomAllReduceV2), flashinfer_pcie_ipc; on request
sm120_hostmem (ours through pinned host memory: IpcAllReduce(memory="host"), ONESHOT/TWOSHOT).

--no-p2p: NCCL without P2P, side by side with ours through host memory (the transport for GPUs without CUDA
P2P). NCCL reads NCCL_P2P_DISABLE once, when its first communicator is created, so the script sets
NCCL_P2P_DISABLE=1 before it initialises NCCL; NCCL is then named nccl_no_p2p (and `nccl` is refused, as is
nccl_no_p2p without --no-p2p). Defaults: --impls nccl_no_p2p,sm120_hostmem, --rows 1,3,4,16,64, the quick flat
sizes, --norm-kernel triton (the add+RMSNorm after NCCL's all-reduce). The JSON records the NCCL environment
NCCL started with, its version, the transports NCCL logged, and the targets at [3, 7168] (schema.NO_P2P_TARGETS:
ours >= 3x faster than NCCL-no-P2P, plain and fused), computed from the measured medians.

Timing: K calls captured back to back into one CUDA graph (inputs rotate between two buffers), warmup
replays, then R timed replays (CUDA events); per call = replay / K; per replay the MAX over ranks (gathered
over gloo afterwards); reported: the MEDIAN over replays. Before timing, each implementation's output is
checked once against NCCL on integer-valued inputs (exact sums); a mismatching implementation is recorded
with an ``error`` and not timed. After timing, the graph's last outputs are checked again.

Writes ``<out>/allreduce_<gpu>_tp<N>.json`` (``..._tp<N>_nop2p.json`` with --no-p2p; rewritten after every
shape, so a killed run leaves partial results with ``"complete": false``) and a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _p in (_ROOT / "python", _ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from benchmarks.harness import io, nccl_mode, norms, ranks, run, timing  # noqa: E402
from benchmarks.harness.io import format_bytes, parse_int_list, parse_size  # noqa: E402
from benchmarks.harness.schema import (  # noqa: E402
    NO_P2P_TARGETS,
    crossover_bytes,
    evaluate_targets,
    validate_allreduce_doc,
)

HIDDEN = 7168
EPS = 1e-6
FULL_SIZES = [1 << k for k in range(10, 27)]  # 1 KB .. 64 MB
QUICK_SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
FULL_ROWS = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
QUICK_ROWS = [1, 3, 4, 16, 64]
OP_AR = "allreduce"
OP_FUSED = "allreduce_add_rmsnorm"


@dataclass(frozen=True)
class Shape:
    shape: tuple
    rows: int | None  # None: flat
    hidden: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.numel

    @property
    def label(self) -> str:
        return f"[{self.rows}, {self.hidden}]" if self.rows is not None else f"flat {format_bytes(self.nbytes)}"


def build_shapes(sizes: list[int], rows: list[int], hidden: int) -> list[Shape]:
    out = []
    for b in sizes:
        if b % 16:
            raise ValueError(f"size {b} B is not a multiple of 16 bytes")
        out.append(Shape((b // 2,), None, None))
    out += [Shape((r, hidden), r, hidden) for r in rows]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None,
                   help="flat sizes, e.g. 1K,64K,4M, or none (default 1K..64M powers of two; --no-p2p: 1K..16M)")
    p.add_argument("--rows", default=None, help="rows of the [rows, hidden] shapes (default 1,2,3,4,8,...,256)")
    p.add_argument("--hidden", type=int, default=HIDDEN,
                   help=f"hidden size of the [rows, hidden] shapes (default {HIDDEN})")
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    p.add_argument("--impls", default=None,
                   help=f"comma list of implementations (default {','.join(_all_impls())}; with --no-p2p "
                        f"{','.join(_no_p2p_impls())}; also known: {','.join(_known_impls())})")
    p.add_argument("--no-p2p", action="store_true",
                   help="NCCL with NCCL_P2P_DISABLE=1 (set before NCCL starts) as `nccl_no_p2p`, against ours "
                        "through host memory (`sm120_hostmem`); output allreduce_<gpu>_tp<N>_nop2p.json")
    p.add_argument("--no-fused", action="store_true", help="skip the all-reduce + add + RMSNorm op")
    p.add_argument("--iters", type=int, default=None, help="timed replays (default 50, quick 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed replays first (default 5, quick 3)")
    p.add_argument("--calls", type=int, default=20, help="calls per graph at <= 1 MB (fewer above)")
    p.add_argument("--out", default=str(io.RESULTS_DIR), help="results folder (default benchmarks/results)")
    p.add_argument("--time-limit", type=float, default=float(os.environ.get("BENCH_TIME_LIMIT_S", "480")),
                   help="seconds; on expiry write partial results (complete: false) and exit 124; 0: off "
                        "(default 480, env BENCH_TIME_LIMIT_S)")
    p.add_argument("--norm-kernel", default=None, choices=["sgl_kernel", "flashinfer", "triton", "torch"],
                   help="preferred add+RMSNorm kernel after plain all-reduces (default: first that works; "
                        "--no-p2p: triton)")
    p.add_argument("--ours-link", default="auto", help="our workspace's link hint: auto | nvlink | pcie")
    p.add_argument("--ours-timeout-s", type=float, default=None, help="our kernels' wait bound (default: theirs)")
    p.add_argument("--ours-islands", default="auto",
                   help="auto (probe; 8 ranks only) | none | halves | '0,1,2,3/4,5,6,7'")
    p.add_argument("--ours-max-bytes", type=str, default=None, help="IpcAllReduce workspace bound (default: largest)")
    p.add_argument("--flashinfer-max-bytes", type=str, default="8M", help="FlashInfer PCIe-IPC workspace bound")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    a = p.parse_args(argv)
    if a.sizes and a.sizes.strip().lower() == "none":
        a.sizes = []
    elif a.sizes:
        a.sizes = [parse_size(s) for s in a.sizes.split(",")]
    else:
        a.sizes = QUICK_SIZES if (a.quick or a.no_p2p) else FULL_SIZES
    a.rows = parse_int_list(a.rows) if a.rows else (QUICK_ROWS if (a.quick or a.no_p2p) else FULL_ROWS)
    a.iters = a.iters or (20 if a.quick else 50)
    a.warmup = a.warmup if a.warmup is not None else (3 if a.quick else 5)
    if a.impls is None:
        a.impls = list(_no_p2p_impls() if a.no_p2p else _all_impls())
    else:
        a.impls = [s for s in a.impls.split(",") if s]
    unknown = [s for s in a.impls if s not in _known_impls()]
    if unknown:
        p.error(f"unknown implementation(s) {','.join(unknown)}; known: {','.join(_known_impls())}")
    if not a.impls:
        p.error("--impls is empty")
    why = nccl_mode.nccl_label_error(a.impls, a.no_p2p)
    if why:
        p.error(why)
    if a.no_p2p and a.norm_kernel is None:
        a.norm_kernel = "triton"  # the peer: NCCL-no-P2P + our Triton add+RMSNorm
    if not a.sizes and not a.rows:
        p.error("nothing to measure: no --sizes and no --rows")
    a.flashinfer_max_bytes = parse_size(a.flashinfer_max_bytes)
    if a.ours_max_bytes:
        a.ours_max_bytes = parse_size(a.ours_max_bytes)
    return a


def _all_impls():
    from benchmarks.peers import ALL_IMPLS

    return ALL_IMPLS


def _no_p2p_impls():
    from benchmarks.peers import NO_P2P_IMPLS

    return NO_P2P_IMPLS


def _known_impls():
    from benchmarks.peers import KNOWN_IMPLS

    return KNOWN_IMPLS


def reference_names(no_p2p: bool) -> tuple[str, str]:
    """(ours, NCCL) of this mode: the pair behind crossover_bytes and the tables' ratio column."""
    return ("sm120_hostmem", nccl_mode.NCCL_NO_P2P) if no_p2p else ("sm120", nccl_mode.NCCL_PLAIN)


def mode_targets(no_p2p: bool) -> tuple:
    return NO_P2P_TARGETS if no_p2p else ()


class Buffers:
    """Per-shape inputs (integer-valued, so every summation order is exact), their NCCL reference sums, and
    the replicated residual / weight of the fused op."""

    def __init__(self, d, sh: Shape, fused: bool):
        import torch
        import torch.distributed as dist

        dev = d.device
        g = torch.Generator(device=dev)
        g.manual_seed(10_007 * (d.rank + 1) + sh.numel % 9973)
        self.ins = [torch.randint(-4, 5, sh.shape, generator=g, device=dev, dtype=torch.int32).to(torch.bfloat16)
                    for _ in range(2)]
        self.ins_orig = [x.clone() for x in self.ins]
        self.ref = [x.clone() for x in self.ins]
        for r in self.ref:
            dist.all_reduce(r, group=d.nccl)
        self.residual = self.weight = None
        if fused and sh.rows is not None:
            gs = torch.Generator(device=dev)
            gs.manual_seed(4242 + sh.numel % 9973)  # same on every rank: replicated, as in TP
            self.residual = torch.randint(-4, 5, sh.shape, generator=gs, device=dev, dtype=torch.int32).to(
                torch.bfloat16
            )
            self.weight = (1 + 0.1 * torch.randn(sh.shape[-1], generator=gs, device=dev)).to(torch.bfloat16)
            self.res_orig = self.residual.clone()
            self.ref_fused = [norms.reference_add_rmsnorm(r, self.residual, self.weight, EPS) for r in self.ref]
        torch.cuda.synchronize()


class Bench(run.Run):
    kind = "allreduce"
    validate = staticmethod(validate_allreduce_doc)

    def __init__(self, d, args, mode: dict | None = None):
        super().__init__(d, args, mode)
        self.ours, self.nccl_name = reference_names(self.no_p2p)
        self.results: list[dict] = []
        self.impl_notes: dict = {}
        self.norm = None
        self.norm_rejected: list = []

    # ---------------------------------------------------------------- output
    def doc(self) -> dict:
        res = list(self.results)

        def medians(impl, op, mode):
            return {
                r["bytes"]: r["median_us"]
                for r in res
                if r["impl"] == impl and r["op"] == op and r["rows"] is None and r.get("variant_mode") == mode
            }

        def medians_rows(label, op):
            return {r["bytes"]: r["median_us"] for r in res if r["label"] == label and r["op"] == op and r["rows"]}

        norm_name = self.norm.name if self.norm else None
        mode = nccl_mode.public_nccl_mode(self.nccl_mode)
        p2p_seen = (mode.get("transports") or {}).get("p2p_seen")
        invalid = "NCCL logged P2P channels in this --no-p2p run" if self.no_p2p and p2p_seen else None
        return {
            "schema_version": io.SCHEMA_VERSION,
            "benchmark": "bench_allreduce",
            "hardware": self.hw,
            "date": io.utc_now(),
            "complete": self.complete,
            "aborted": self.aborted,
            "no_p2p": self.no_p2p,
            "nccl_setup": {**mode, "nccl_version": self.hw.get("nccl")},
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "settings": {
                "sizes": self.args.sizes,
                "rows": self.args.rows,
                "hidden": self.args.hidden,
                "iters": self.args.iters,
                "warmup_replays": self.args.warmup,
                "calls_per_graph_base": self.args.calls,
                "statistic": "median over replays of the max over ranks of (replay time / calls per replay)",
                "eps": EPS,
            },
            "norm_kernel": norm_name,
            "norm_kernels_rejected": [{"kernel": k, "reason": r} for k, r in self.norm_rejected],
            "impl_notes": self.impl_notes,
            "results": res,
            "skipped": list(self.skipped),
            "crossover_pair": [self.ours, self.nccl_name],
            "crossover_bytes": crossover_bytes(medians(self.ours, OP_AR, "dispatch"),
                                               medians(self.nccl_name, OP_AR, "dispatch")),
            "crossover_bytes_fused_rows": crossover_bytes(
                medians_rows(self.ours, OP_FUSED), medians_rows(f"{self.nccl_name}+add_rmsnorm", OP_FUSED)
            ),
            "targets": evaluate_targets(res, mode_targets(self.no_p2p), norm_kernel=norm_name, invalid=invalid),
        }

    # ---------------------------------------------------------------- setup
    def setup_impls(self, max_numel: int):
        from benchmarks.peers import Skip, make_impl

        impls = []
        for name in self.args.impls:
            impl = make_impl(name, self.args)
            numel = max_numel
            if name in ("sm120", "sm120_hostmem") and self.args.ours_max_bytes:
                numel = self.args.ours_max_bytes // 2
            try:
                impl.setup(self.d, numel)
            except Skip as e:
                self.skip(name, str(e))
                continue
            self.impl_notes[name] = impl.notes()
            self.d.log(f"  ready: {name} {impl.notes()}")
            impls.append(impl)
        return impls

    # ---------------------------------------------------------------- one case
    def make_step(self, impl, op, variant, B: Buffers):
        import torch

        n = self.norm
        if op == OP_AR:
            if impl.inplace:
                # In-place and repeated: zeros keep the values bounded (NCCL's time does not depend on them).
                z = [torch.zeros_like(B.ins[0]) for _ in range(2)]
                return lambda k: impl.all_reduce(z[k % 2])
            if impl.accepts_out:
                outs = [torch.empty_like(B.ins[0]) for _ in range(2)]
                return lambda k: impl.all_reduce(B.ins[k % 2], outs[k % 2], variant)
            return lambda k: impl.all_reduce(B.ins[k % 2], None, variant)
        if impl.native_fused:
            no = [torch.empty_like(B.ins[0]) for _ in range(2)]
            ro = [torch.empty_like(B.residual) for _ in range(2)]
            return lambda k: impl.all_reduce_add_rmsnorm(
                B.ins[k % 2], B.residual, B.weight, EPS, no[k % 2], ro[k % 2], variant
            )
        res = [B.residual.clone() for _ in range(2)]
        if impl.inplace:
            bufs = [B.ins[j].clone() for j in range(2)]  # the norm brings each call's input back to O(1)

            def step(k):
                b = bufs[k % 2]
                impl.all_reduce(b)
                n.add_rmsnorm_(b, res[k % 2], B.weight, EPS)
                return b

            return step
        outs = [torch.empty_like(B.ins[0]) for _ in range(2)] if impl.accepts_out else None

        def step2(k):
            o = impl.all_reduce(B.ins[k % 2], outs[k % 2] if outs else None, variant)
            n.add_rmsnorm_(o, res[k % 2], B.weight, EPS)
            return o

        return step2

    def check_once(self, impl, op, variant, B: Buffers):
        """Eager check against NCCL. Returns (mismatch or None, digest of the output for cross-rank check)."""
        import torch

        if op == OP_AR:
            mism, dig = None, None
            for j in range(2):
                x = B.ins[j].clone() if impl.inplace else B.ins[j]
                out = torch.empty_like(x) if (impl.accepts_out and not impl.inplace) else None
                y = impl.all_reduce(x, out, variant)
                torch.cuda.synchronize()
                if not torch.equal(y, B.ref[j]):
                    mism = mism or f"all_reduce != NCCL sum (max |diff| {(y.float() - B.ref[j].float()).abs().max():g})"
                if not torch.equal(B.ins[j], B.ins_orig[j]):
                    mism = mism or "input was modified"
                dig = dig or ranks.tensor_digest(y)
            return mism, dig
        mism, dig = None, None
        for j in range(2):
            ref_n, ref_r = B.ref_fused[j]
            if impl.native_fused:
                n_out, r_out = impl.all_reduce_add_rmsnorm(B.ins[j], B.residual, B.weight, EPS, None, None, variant)
            else:
                x = B.ins[j].clone() if impl.inplace else B.ins[j]
                out = torch.empty_like(x) if (impl.accepts_out and not impl.inplace) else None
                n_out = impl.all_reduce(x, out, variant)
                r_out = B.residual.clone()
                self.norm.add_rmsnorm_(n_out, r_out, B.weight, EPS)
            torch.cuda.synchronize()
            if not torch.equal(r_out, ref_r):
                diff = (r_out.float() - ref_r.float()).abs().max()
                mism = mism or f"residual_out != NCCL sum + residual (max |diff| {diff:g})"
            if not torch.allclose(n_out.float(), ref_n.float(), rtol=1 / 64, atol=1 / 64):
                mism = mism or f"norm_out off (max |diff| {(n_out.float() - ref_n.float()).abs().max():g})"
            if not torch.equal(B.ins[j], B.ins_orig[j]) or not torch.equal(B.residual, B.res_orig):
                mism = mism or "an input was modified"
            dig = dig or (ranks.tensor_digest(n_out) + ranks.tensor_digest(r_out))
        return mism, dig

    def post_check(self, impl, op, outs, B: Buffers) -> str | None:
        """The graph's last two outputs against the references (out-of-place implementations only)."""
        import torch

        K = len(outs)
        for k in range(max(0, K - 2), K):
            j = k % 2
            if op == OP_AR:
                if not torch.equal(outs[k], B.ref[j]):
                    return "graph replay output != NCCL sum"
            else:
                n_out, r_out = outs[k]
                if not torch.equal(r_out, B.ref_fused[j][1]):
                    return "graph replay residual_out != reference"
                if not torch.allclose(n_out.float(), B.ref_fused[j][0].float(), rtol=1 / 64, atol=1 / 64):
                    return "graph replay norm_out off"
        return None

    def record_error(self, entry: dict, sh: Shape, error: str) -> None:
        """A case whose output was wrong: recorded with its error and no time."""
        entry["error"] = error
        self.results.append(entry)
        self.d.log(f"  {entry['label']:<34} {entry['op']:<22} {sh.label:<16} ERROR {error}")

    def run_case(self, impl, op, sh: Shape, vlabel, variant, B: Buffers) -> None:
        import torch

        d = self.d
        label = impl.name if vlabel is None else f"{impl.name}[{vlabel}]"
        if op == OP_FUSED and not impl.native_fused:
            label += "+add_rmsnorm"
        where = {"op": op, "bytes": sh.nbytes, "rows": sh.rows, "label": label}
        entry = {
            "impl": impl.name,
            "label": label,
            "op": op,
            "rows": sh.rows,
            "hidden": sh.hidden,
            "shape": list(sh.shape),
            "dtype": "bfloat16",
            "bytes": sh.nbytes,
            "world_size": d.world_size,
            "median_us": None,
            "variant": vlabel if vlabel is not None else impl.dispatch_variant(sh.nbytes),
            "variant_mode": "dispatch" if vlabel is None else "forced",
        }

        def supported():
            if not impl.supports(B.ins[0], fused=op == OP_FUSED):
                raise RuntimeError("unsupported shape (supports() is False)")

        ok, _, why = d.attempt(supported, "supports")
        if not ok:
            self.skip(impl.name, why, **where)
            return
        ok, _, why = d.attempt(lambda: impl.prepare_shape(sh.shape), "prepare")
        if not ok:
            self.skip(impl.name, why, **where)
            return
        ok, val, why = d.attempt(lambda: self.check_once(impl, op, variant, B), "eager check")
        if not ok:
            self.skip(impl.name, why, **where)
            self.check_health()
            return
        mism, dig = val
        ok, why = d.agree(mism is None, mism)
        if not ok:
            self.record_error(entry, sh, f"mismatch vs NCCL: {why}")
            return
        entry["bitwise_across_ranks"] = len(set(d.all_gather_obj(dig))) == 1
        entry["check"] = "ok"

        calls = timing.calls_per_replay(sh.nbytes, self.args.calls)
        step = self.make_step(impl, op, variant, B)

        def capture():
            with impl.capture_context():
                return timing.capture_graph(step, calls, eager_warmup=1)

        ok, val, why = d.attempt(capture, "graph capture")
        if not ok:
            self.skip(impl.name, why, **where)
            self.check_health()
            return
        graph, outs = val
        try:
            t = timing.time_graph(d, graph, calls=calls, iters=self.args.iters, warmup=self.args.warmup)
        except RuntimeError as e:
            self.skip(impl.name, io.short_exc(e), **where)
            self.check_health()
            return
        if (op == OP_AR and not impl.inplace) or (op == OP_FUSED and impl.native_fused):
            ok, msg, why = d.attempt(lambda outs=outs: self.post_check(impl, op, outs, B), "post-graph check")
            bad = why if not ok else msg
            ok2, why2 = d.agree(bad is None, bad)
            if not ok2:
                self.record_error(entry, sh, f"after graph replay: {why2}")
                return
        entry.update(t)
        self.results.append(entry)
        v = f" ({entry['variant']})" if entry["variant"] and vlabel is None else ""
        d.log(f"  {label:<34} {op:<22} {sh.label:<16} {t['median_us']:9.2f} us{v}")
        graph = outs = None
        torch.cuda.synchronize()

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        import torch

        d, a = self.d, self.args
        shapes = build_shapes(a.sizes, a.rows, a.hidden)
        max_numel = max(s.numel for s in shapes)
        d.log(f"bench_allreduce: {self.hw['gpu']} x{d.world_size}, torch {self.hw['torch']}, "
              f"NCCL {self.hw['nccl']}{' (P2P disabled: NCCL_P2P_DISABLE=1)' if self.no_p2p else ''}, "
              f"{len(shapes)} shapes, iters {a.iters}")
        if not a.no_fused and a.rows:
            self.norm, self.norm_rejected = norms.select_norm_kernel(d, a.hidden, EPS, prefer=a.norm_kernel)
            d.log(f"  add+RMSNorm kernel after plain all-reduces: {self.norm.name}")
        impls = self.setup_impls(max_numel)
        if self.no_p2p:
            nccl_mode.collect_nccl_transports(d, self.nccl_mode)  # NCCL's channels so far (init + references)
        self.write()
        try:
            for sh in shapes:
                ops = [OP_AR] + ([OP_FUSED] if sh.rows is not None and self.norm is not None else [])
                B = Buffers(d, sh, fused=OP_FUSED in ops)
                for impl in impls:
                    for op in ops:
                        for vlabel, variant in impl.variants():
                            self.run_case(impl, op, sh, vlabel, variant, B)
                del B
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                self.write()
            self.complete = True
        except run.Abort as e:
            d.log(f"ABORTED: {e}")
        finally:
            for impl in impls:
                impl.close()
        if self.no_p2p:
            nccl_mode.collect_nccl_transports(d, self.nccl_mode)  # again: channels connected during the run
        self.write()
        if d.is_main:
            self.print_tables()
            if not a.no_plot:
                self.plot()

    # ---------------------------------------------------------------- reporting
    def print_tables(self) -> None:
        doc = self.doc()
        for op, base in ((OP_AR, self.ours), (OP_FUSED, self.ours)):
            rs = [r for r in doc["results"] if r["op"] == op]
            if not rs:
                continue
            labels = io.iter_unique(r["label"] for r in rs)
            keys = io.iter_unique((r["rows"], r["bytes"]) for r in rs)
            io.table_print(f"\n== {op}  (us per call, median of slowest rank; (x) = time / {base}'s, "
                               ">1 means ours is faster)")
            io.table_print(f"{'shape':<16}{'bytes':>9} " + "".join(f"{lb[:22]:>24}" for lb in labels))
            for rows, nb in keys:
                cells = {r["label"]: r for r in rs if r["rows"] == rows and r["bytes"] == nb}
                ours = cells.get(base, {}).get("median_us")
                line = f"{(f'[{rows}, {self.args.hidden}]' if rows else 'flat'):<16}{format_bytes(nb):>9} "
                for lb in labels:
                    c = cells.get(lb)
                    if c is None:
                        line += f"{'-':>24}"
                    elif c.get("error"):
                        line += f"{'ERROR':>24}"
                    else:
                        rt = io.ratio(c["median_us"], ours)
                        line += f"{c['median_us']:>15.2f}" + (f" ({rt:5.2f}x)" if rt else " " * 9)
                io.table_print(line)
        io.table_print(f"\ncrossover_bytes ({self.ours} <= {self.nccl_name} at every size up to here): "
                           f"{doc['crossover_bytes']}")
        for t in doc["targets"]:
            io.table_print(format_target(t))
        if doc.get("nccl_setup"):
            io.table_print(nccl_mode.nccl_setup_line(doc["nccl_setup"]))
        if doc["skipped"]:
            io.table_print("skipped:")
            grouped: dict = {}
            for s in doc["skipped"]:
                grouped.setdefault((s.get("label", s["impl"]), s.get("op"), s["reason"]), []).append(s.get("bytes"))
            for (label, op, reason), sizes in grouped.items():
                where = f" [{op}; {len(sizes)} shape(s)]" if op else ""
                io.table_print(f"  {label}{where}: {reason}")
        io.table_print(f"wrote {self.out_json}")

    def plot(self) -> None:
        doc = self.doc()
        panels = []
        for title, op, flat in (
            ("all-reduce, flat bf16", OP_AR, True),
            (f"all-reduce, [rows, {self.args.hidden}] bf16", OP_AR, False),
            (f"all-reduce + add + RMSNorm, [rows, {self.args.hidden}]", OP_FUSED, False),
        ):
            rs = [r for r in doc["results"] if r["op"] == op and (r["rows"] is None) == flat and r["median_us"]]
            if not rs:
                continue
            series = {}
            for lb in io.iter_unique(r["label"] for r in rs):
                pts = sorted((r["bytes"], r["median_us"]) for r in rs if r["label"] == lb)
                series[lb] = ([p[0] for p in pts], [p[1] for p in pts])
            panels.append({"title": title, "xlabel": "bytes", "ylabel": "us per call (median, slowest rank)",
                           "logx": 2, "logy": True, "series": series})
        if not panels:
            return
        png = self.out_json.with_suffix(".png")
        hw = self.hw
        nccl = f"NCCL {hw['nccl']}" + (" with P2P disabled" if self.no_p2p else "")
        err = io.plot_lines(png, panels, title=f"{hw['gpu']} x{self.d.world_size}, torch {hw['torch']}, "
                                                   f"{nccl}, {doc['date'][:10]}")
        print(f"plot: {err or png}")


def format_target(t: dict) -> str:
    head = f"target {t['target']}: {t['ours']} vs {t['peer']} at [{t['rows']}, {t['hidden']}] ({t['op']}), need " \
           f">= {t['required_speedup']:g}x faster: "
    if t["met"] is None:
        return head + f"NOT EVALUATED ({t['why']})"
    return head + (f"{t['ours_us']:.2f} vs {t['peer_us']:.2f} us = {t['speedup']:.2f}x: "
                   + ("MET" if t["met"] else "MISSED"))


def main(argv=None) -> int:
    args = parse_args(argv)
    uses_nccl = bool({nccl_mode.NCCL_PLAIN, nccl_mode.NCCL_NO_P2P} & set(args.impls))
    return run.main("benchmarks/bench_allreduce.py", args, uses_nccl, Bench, in_process=argv is not None)


if __name__ == "__main__":
    sys.exit(main())
