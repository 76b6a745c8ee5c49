#!/usr/bin/env python3
"""How much faster does the EAGLE-3 verify step get? Replays one target-verify forward's communication.

    torchrun --nproc-per-node N benchmarks/bench_verify.py [--config kimi_k25] [--backend both|NAME[,NAME...]]
             [--compute none|gemm|none,gemm] [--tokens 1,2,3,4,8,16,32,64] [--via-sglang] [--no-p2p] [--out DIR]

One graph per (backend, compute, T) holds one whole forward of the model in
``benchmarks/workloads/configs/<config>.json`` (the op list comes from ``verify_pattern.build_verify_pattern``;
Kimi-K2.5: 123 all-reduces of [T, 7168] bf16):

- ``nccl``: what SGLang runs on SM120 today: every all-reduce is NCCL (in place), and every norm after one is
  one fused add + RMSNorm kernel (sgl_kernel's or FlashInfer's if they work here, else our Triton kernel).
- ``sm120``: ours: ``all_reduce_add_rmsnorm`` where the pattern fuses (121, or 118 with the EAGLE-3 capture
  layers, whose preceding MoE all-reduce is not deferred), ``all_reduce`` + the same norm kernel elsewhere.
- ``sm120_hostmem``: ours through pinned host memory (``IpcAllReduce(memory="host")``, the transport for GPUs
  without CUDA P2P), fused like ``sm120``.
- ``nccl_no_p2p`` (``--no-p2p`` only): ``nccl`` with NCCL_P2P_DISABLE=1, set before NCCL starts (its
  shared-memory transport). In that mode ``--backend both`` means nccl_no_p2p,sm120_hostmem, ``nccl`` is refused,
  NCCL-no-P2P is the reference of the comparisons, and the output is ``verify_<gpu>_tp<N>_nop2p.json``.
- ``--compute none``: communication (and norms) only: step time = communication time.
  ``--compute gemm``: each layer also runs bf16 GEMMs with the per-rank shapes at TP=N (MLA projections,
  routed experts of the expected active count, shared expert, dense MLP), and a third, compute-only graph is
  timed (all-reduces removed); comm_us = step_us - compute-only step_us.
- ``--via-sglang``: the same pattern through SGLang's ``GroupCoordinator.all_reduce`` and
  ``RMSNorm.forward_with_allreduce_fusion`` (behind SGLang's fusion gate), overlay off and then on. ``sglang_on``
  routes as a server on this box would; without a measured table that is NCCL for every size, which the run
  warns of and records in its notes (tune first: ``python -m sglang_sm120.tune``).
- ``--shared-gpu``: a CORRECTNESS run with the ranks sharing the visible GPUs (one lent GPU): torch's default
  group and SGLang's groups on gloo (NCCL refuses two ranks on one GPU), SGLang's pynccl and own custom
  all-reduces off (tests/gpu/sglang_harness.py's patches); ``sglang_on`` routes by the seeds (the tune off, a
  cache of the run's own). Only ``sm120`` runs directly; ``nccl`` and
  ``sglang_off`` (a gloo reduction cannot be captured in a CUDA graph) do not; ``sm120`` is the reference the
  final hidden states of ``sglang_on`` are compared with. The JSON says ``"timings_meaningful": false`` and has
  no end-to-end estimate; output ``verify_<gpu>_tp<N>_shared.json``.

Timing: per graph, warmup replays then R timed replays (CUDA events); per replay the MAX over ranks; the MEDIAN.
After the timing the final hidden states are compared between backends (rms(diff)/rms <= ``FINAL_REL_TOL``) and
across ranks (bitwise). Output: a table per compute mode, ``<out>/verify_<gpu>_tp<N>.json`` (merged with an
existing file of the same config and world size: a later ``--compute gemm`` run adds to a ``--compute none``
one), a PNG plot of step time vs T, and an end-to-end ESTIMATE (see ``schema.e2e_estimate``) at README's verify
shape, T = 4, with the tokens per verify step an input (``--e2e-accept-len``, default from the users' figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _p in (_ROOT / "python", _ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from benchmarks.harness import io, nccl_mode, norms, ranks, run, timing  # noqa: E402
from benchmarks.harness.io import parse_int_list, short_exc  # noqa: E402
from benchmarks.harness.schema import e2e_estimate, validate_verify_doc  # noqa: E402
from benchmarks.workloads import sglang_compat  # noqa: E402
from benchmarks.workloads import verify_pattern as vp  # noqa: E402
from benchmarks.workloads.verify_model import (  # noqa: E402
    ComputeOnly,
    Model,
    NcclComm,
    NcclNoP2pComm,
    SglangComm,
    Sm120Comm,
)

DEFAULT_TOKENS = [1, 2, 3, 4, 8, 16, 32, 64]
# The verify shape of README's launch: one request verifies --speculative-num-draft-tokens 4 rows of [*, 7168].
DEFAULT_VERIFY_TOKENS = 4
# The estimate's tokens per verify step. It is an input, not derived from the NCCL this run measured (on NVLink
# that made EAGLE-3 look like 0.37 tokens a step): the users' box serves 60 tok/s with EAGLE-3 on NCCL at a
# 30 ms verify step, 1.8 tokens a step.
USERS_TOK_S_EAGLE_NCCL, USERS_VERIFY_MS = 60.0, 30.0
USERS_ACCEPT_LEN = USERS_TOK_S_EAGLE_NCCL * USERS_VERIFY_MS / 1000.0
USERS_ACCEPT_SOURCE = (f"the users' figures: {USERS_TOK_S_EAGLE_NCCL:g} tok/s with EAGLE-3 on NCCL at a "
                       f"{USERS_VERIFY_MS:g} ms verify step")

# Final hidden states of the two backends are compared by rms(nccl - sm120) / rms(nccl). They are not bitwise
# equal in general: the fused path rounds the residual once (bf16(sum + r), sum in fp32) where NCCL + separate
# norm rounds twice (bf16(bf16(sum) + r), and at >2 ranks NCCL also rounds partial sums), so each of the 2L+1
# boundaries may differ by about one bf16 ulp (2^-8 relative), which the GEMMs then carry forward. CPU
# emulations of the tiny test config (tests/bench/test_verify.py) give <= 0.015 at 2-8 ranks with GEMMs, and
# exactly 0 for communication only at 2 ranks (identical partials: the sum is exact and both round once);
# a fused op that forgets its all-reduce gives >= 0.9 with GEMMs. 0.05 sits well between the two.
FINAL_REL_TOL = 0.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="kimi_k25",
                   help=f"name in benchmarks/workloads/configs ({', '.join(vp.available_configs())}) or a JSON path")
    p.add_argument("--backend", default="both",
                   help=f"both | comma list of {', '.join(BACKENDS)}; both = nccl,sm120 (--no-p2p: "
                        "nccl_no_p2p,sm120_hostmem)")
    p.add_argument("--no-p2p", action="store_true",
                   help="NCCL with NCCL_P2P_DISABLE=1 (set before NCCL starts) as `nccl_no_p2p`, against ours "
                        "through host memory; output verify_<gpu>_tp<N>_nop2p.json")
    p.add_argument("--compute", default="none", help="none | gemm | none,gemm")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="T = batch x draft tokens")
    p.add_argument("--no-eagle3-capture", action="store_true", help="ignore the config's EAGLE-3 capture layers")
    p.add_argument("--iters", type=int, default=20, help="timed replays of each forward's graph")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays first")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights")
    p.add_argument("--via-sglang", action="store_true", help="also drive the pattern through SGLang (overlay off/on)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="correctness only: ranks share the GPUs, every group on gloo, timings meaningless (see above)")
    p.add_argument("--sglang-custom-ar", default="off", choices=["on", "off"],
                   help="SGLang's own custom all-reduce in --via-sglang (off mimics PCIe boxes, where it is disabled)")
    p.add_argument("--norm-kernel", default=None, choices=["sgl_kernel", "flashinfer", "triton", "torch"],
                   help="add+RMSNorm kernel of the unfused norms (default: first that works; --no-p2p: triton)")
    p.add_argument("--ours-link", default="auto", help="our workspace's link hint: auto | nvlink | pcie")
    p.add_argument("--ours-islands", default="auto",
                   help="auto (probe; 8 ranks only) | none | halves | '0,1,2,3/4,5,6,7'")
    p.add_argument("--ours-timeout-s", type=float, default=None, help="our kernels' wait bound (default: theirs)")
    p.add_argument("--max-expert-gib", type=float, default=40.0, help="cap on the routed-expert weights per rank")
    p.add_argument("--e2e-compute-ms", default="5,8", help="compute time(s) per verify forward for the estimate")
    p.add_argument("--e2e-tokens", type=int, default=DEFAULT_VERIFY_TOKENS,
                   help="T the estimate uses (README's launch: bs 1 x --speculative-num-draft-tokens 4)")
    p.add_argument("--e2e-accept-len", type=float, default=USERS_ACCEPT_LEN,
                   help=f"tokens per verify step (default {USERS_ACCEPT_LEN:g}: {USERS_ACCEPT_SOURCE})")
    p.add_argument("--e2e-tok-s-nospec", type=float, default=82.0,
                   help="tokens/s without speculation, for the estimate")
    p.add_argument("--out", default=str(io.RESULTS_DIR), help="results folder (default benchmarks/results)")
    p.add_argument("--no-merge", action="store_true", help="overwrite instead of merging with an existing JSON")
    p.add_argument("--time-limit", type=float, default=float(os.environ.get("BENCH_TIME_LIMIT_S", "480")),
                   help="seconds; on expiry write partial results (complete: false) and exit 124; 0: off "
                        "(default 480, env BENCH_TIME_LIMIT_S)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    a = p.parse_args(argv)
    a.tokens = sorted(set(parse_int_list(a.tokens)))
    a.compute = [c for c in a.compute.split(",") if c]
    bad = [c for c in a.compute if c not in ("none", "gemm")]
    if bad or not a.compute:
        p.error(f"--compute takes none, gemm or none,gemm (got {','.join(a.compute)})")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens needs positive integers")
    a.backends = backends_of(a.backend, a.no_p2p)
    if a.shared_gpu:
        if a.backend.strip() == "both":
            a.backends = ["sm120"]
        if a.no_p2p or set(a.backends) != {"sm120"} or a.sglang_custom_ar == "on":
            p.error("--shared-gpu runs ours only (backend sm120, no --no-p2p, --sglang-custom-ar off): NCCL refuses "
                    "two ranks on one GPU and gloo cannot be captured in a CUDA graph")
    unknown = [b for b in a.backends if b not in BACKENDS]
    if unknown or not a.backends:
        p.error(f"--backend takes both or a comma list of {', '.join(BACKENDS)} (got {a.backend!r})")
    why = nccl_mode.nccl_label_error(a.backends, a.no_p2p)
    if why:
        p.error(why)
    if a.no_p2p and a.via_sglang:
        p.error("--via-sglang with --no-p2p is not supported: SGLang's phases would run NCCL without P2P under "
                "the names sglang_off/sglang_on")
    if a.no_p2p and a.norm_kernel is None:
        a.norm_kernel = "triton"  # as bench_allreduce --no-p2p: NCCL-no-P2P + our Triton add+RMSNorm
    a.e2e_compute_ms = [float(x) for x in a.e2e_compute_ms.split(",") if x]
    return a


BACKENDS = ("nccl", "sm120", "sm120_hostmem", nccl_mode.NCCL_NO_P2P)
OURS_BACKENDS = ("sm120", "sm120_hostmem")  # fused: all_reduce_add_rmsnorm where the pattern fuses


def backends_of(text: str, no_p2p: bool) -> list[str]:
    if text.strip() == "both":
        return [nccl_mode.NCCL_NO_P2P, "sm120_hostmem"] if no_p2p else ["nccl", "sm120"]
    return io.iter_unique(b.strip() for b in text.split(",") if b.strip())


def reference_backends(backends: list[str], no_p2p: bool) -> tuple[str, str]:
    """(NCCL reference, ours) of a run: what the comparisons, the speed-up column and the estimate use."""
    ref = nccl_mode.NCCL_NO_P2P if no_p2p else "nccl"
    ours = "sm120_hostmem" if (no_p2p or "sm120" not in backends) and "sm120_hostmem" in backends else "sm120"
    return ref, ours


# What must be the same for two runs' rows to stand in one file (their ratios and the e2e estimate compare them).
MERGE_HARDWARE_FIELDS = ("gpu", "capability", "driver", "cuda", "torch", "nccl", "world_size")


def measured_on(hw: dict) -> dict:
    return {name: hw.get(name) for name in MERGE_HARDWARE_FIELDS}


def merge_refusal(old: dict, hw: dict, settings: dict) -> str | None:
    """Why an existing result file's rows must not be kept beside this run's, or None: another GPU, driver or
    software stack, or other timing settings."""
    differing = [f"{name} {a!r} there, {b!r} here"
                 for name, a, b in ((n, old.get("hardware", {}).get(n), hw.get(n)) for n in MERGE_HARDWARE_FIELDS)
                 if a != b]
    old_settings = old.get("settings", {})
    differing += [f"{name} {old_settings.get(name)!r} there, {value!r} here" for name, value in settings.items()
                  if old_settings.get(name) != value]
    return "; ".join(differing) or None


class Bench(run.Run):
    kind = "verify"
    validate = staticmethod(validate_verify_doc)

    def __init__(self, d, args, mode: dict | None = None):
        self.shared = bool(getattr(args, "shared_gpu", False))
        super().__init__(d, args, mode)
        self.ref, self.ours = reference_backends(args.backends, self.no_p2p)
        if self.shared:
            self.ref = "sm120"  # no NCCL here: ours driven directly is what sglang_on is compared with
        self.cfg = vp.load_config(args.config)
        self.capture = not args.no_eagle3_capture
        self.results: list[dict] = []
        self.checks: list[dict] = []
        self.sglang_info: list[dict] = []
        self.notes: dict = {}
        self.finals: dict = {}  # (compute, T) -> NCCL's final hidden states (for the --via-sglang comparison)
        self.run_info = {"date": io.utc_now(), "compute": args.compute, "backends": args.backends,
                         "tokens": args.tokens, "via_sglang": args.via_sglang, "no_p2p": self.no_p2p}
        self.prior = self.load_prior() if d.is_main else None

    # ------------------------------------------------------------------ output
    def pattern_info(self) -> dict:
        fused = vp.build_verify_pattern(self.cfg, fuse=True, eagle3_capture=self.capture)
        info = vp.summarize_pattern(fused)
        info["eagle3_capture_layers"] = list(self.cfg.eagle3_capture_layers) if self.capture else []
        info["n_allreduce_nccl_path"] = vp.summarize_pattern(
            vp.build_verify_pattern(self.cfg, fuse=False, eagle3_capture=self.capture))["n_allreduce"]
        return info

    def estimates(self, results) -> list[dict]:
        a = self.args
        T = a.e2e_tokens

        def comm(backend):
            rs = [r for r in results if r["backend"] == backend and r["compute"] == "none" and r["tokens"] == T]
            return rs[0]["comm_us"] if rs else None

        n, s = comm(self.ref), comm(self.ours)
        if n is None or s is None or self.shared:
            return []
        out = []
        for c in a.e2e_compute_ms:
            e = e2e_estimate(n, s, c, tok_s_nospec=a.e2e_tok_s_nospec, accept_len=a.e2e_accept_len)
            e.update({"tokens": T, "nccl_backend": self.ref, "ours_backend": self.ours,
                      "accept_len_source": USERS_ACCEPT_SOURCE if a.e2e_accept_len == USERS_ACCEPT_LEN else "given",
                      "label": "ESTIMATE, not a measurement: step = compute_ms + measured comm "
                      "(compute none) on this machine; tok/s = accept_len / step"})
            out.append(e)
        return out

    def timing_settings(self) -> dict:
        return {"iters": self.args.iters, "warmup_replays": self.args.warmup}

    def load_prior(self) -> dict | None:
        """An existing result file of the same config and world size (read once, before this run writes)."""
        if self.args.no_merge or not self.out_json.is_file():
            return None
        try:
            old = json.loads(self.out_json.read_text())
        except Exception as e:  # noqa: BLE001
            self.notes["merge"] = f"could not read the existing file: {short_exc(e)}"
            return None
        same = (old.get("config", {}).get("name") == self.cfg.name and old.get("world_size") == self.d.world_size
                and old.get("pattern", {}).get("n_fused") == self.pattern_info()["n_fused"]
                and bool(old.get("no_p2p", False)) == self.no_p2p)
        if not same:
            self.notes["merge"] = "existing file is for another config/world size/pattern: overwritten"
            return None
        refusal = merge_refusal(old, self.hw, self.timing_settings())
        if refusal:
            self.notes["merge"] = f"existing file was measured otherwise ({refusal}): overwritten"
            return None
        return old

    def doc(self) -> dict:
        results, checks, skipped = list(self.results), list(self.checks), list(self.skipped)
        norm = self.norm.name if getattr(self, "norm", None) else None
        runs = [{**self.run_info, "measured_on": measured_on(self.hw), **self.timing_settings(), "norm_kernel": norm}]
        old = self.prior
        if old and old.get("norm_kernel") != norm:
            self.notes["merge"] = (f"existing file's rows used the norm kernel {old.get('norm_kernel')!r}, this run "
                                   f"{norm!r}: overwritten")
            old = None
        if old:
            def key(r):
                return r["backend"], r["compute"], r["tokens"]

            mine = {key(r) for r in results}
            results = [r for r in old.get("results", []) if key(r) not in mine] + results
            mine_c = {(c["compute"], c["tokens"], c.get("backend")) for c in checks}
            checks = [c for c in old.get("checks", []) if (c["compute"], c["tokens"], c.get("backend")) not in mine_c]
            checks += list(self.checks)
            computes = set(self.args.compute)
            skipped = [s for s in old.get("skipped", []) if s.get("compute") and s["compute"] not in computes]
            skipped += list(self.skipped)
            runs = old.get("runs", []) + runs
        results.sort(key=lambda r: (r["compute"], r["tokens"], r["backend"]))
        return {
            "schema_version": io.SCHEMA_VERSION,
            "benchmark": "bench_verify",
            "hardware": self.hw,
            "date": io.utc_now(),
            "complete": self.complete,
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "config": self.cfg.to_dict(),
            "world_size": self.d.world_size,
            "no_p2p": self.no_p2p,
            "shared_gpu": self.shared,
            "timings_meaningful": not self.shared,
            "nccl_setup": {**nccl_mode.public_nccl_mode(self.nccl_mode), "nccl_version": self.hw.get("nccl")},
            "reference_backend": self.ref,
            "ours_backend": self.ours,
            "pattern": self.pattern_info(),
            "settings": {"iters": self.args.iters, "warmup_replays": self.args.warmup,
                         "statistic": "median over replays of the max over ranks of one forward's replay time",
                         "final_rel_tol": FINAL_REL_TOL},
            "norm_kernel": self.norm.name if getattr(self, "norm", None) else None,
            "notes": self.notes,
            "results": results,
            "checks": checks,
            "sglang": self.sglang_info,
            "e2e_estimate": self.estimates(results),
            "skipped": skipped,
            "runs": runs,
        }

    # ------------------------------------------------------------------ one graph
    def time_forward(self, model: Model, comm, compute: str, T: int, *, stream=None, label=None) -> dict | None:
        import torch

        d = self.d
        label = label or comm.name
        ops = vp.build_verify_pattern(self.cfg, fuse=comm.fuse, eagle3_capture=self.capture)
        h_buf = torch.empty(T, self.cfg.hidden_size, dtype=torch.bfloat16, device=d.device)

        def fwd(_k):
            return model.forward(ops, comm, self.norm, T, h_buf)

        def capture():
            return timing.capture_graph(fwd, 1, eager_warmup=1, stream=stream)

        ok, val, why = d.attempt(capture, f"{label}: capture")
        if not ok:
            self.skip(label, why, compute=compute, tokens=T)
            self.check_health()
            return None
        graph, outs = val
        try:
            t = timing.time_graph(d, graph, calls=1, iters=self.args.iters, warmup=self.args.warmup)
        except RuntimeError as e:
            self.skip(label, short_exc(e), compute=compute, tokens=T)
            self.check_health()
            return None
        final = outs[0][0].clone()
        torch.cuda.synchronize()
        t["final"] = final
        same = ranks.bitwise_equal_across_ranks(d, final)
        # Without all-reduces (compute-only graph) the ranks' outputs differ by construction.
        t["bitwise_across_ranks"] = same if comm.name != "none" else None
        return t

    def record(self, backend, compute, T, t, comm_us, **extra) -> None:
        pat = self.pattern_info()
        entry = {
            "backend": backend,
            "compute": compute,
            "tokens": T,
            "hidden": self.cfg.hidden_size,
            "bytes_per_allreduce": T * self.cfg.bytes_per_token,
            "world_size": self.d.world_size,
            "n_allreduce": pat["n_allreduce"],
            "n_fused": pat["n_fused"] if backend in (*OURS_BACKENDS, "sglang_on") else 0,
            "step_us": t["median_us"],
            "comm_us": comm_us,
            "p10_us": t["p10_us"],
            "p90_us": t["p90_us"],
            "min_us": t["min_us"],
            "iters": t["iters"],
            "bitwise_across_ranks": t["bitwise_across_ranks"],
            **extra,
        }
        self.results.append(entry)

    def compare(self, compute, T, a_name, a, b_name, b) -> None:
        import torch

        diff = (a.float() - b.float()).abs()
        rms = float(a.float().pow(2).mean().sqrt())
        c = {
            "compute": compute,
            "tokens": T,
            "backend": b_name,
            "reference": a_name,
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "rms_reference": rms,
            "max_rel_diff": float(diff.max()) / rms if rms > 0 else None,
            "rel_rms_diff": float(diff.pow(2).mean().sqrt()) / rms if rms > 0 else None,
            "bitwise_equal": bool(torch.equal(a, b)),
            "tolerance": FINAL_REL_TOL,
        }
        c["ok"] = c["rel_rms_diff"] is not None and c["rel_rms_diff"] <= FINAL_REL_TOL
        self.checks.append(c)
        if not c["ok"]:
            self.d.log(f"  WARNING: {b_name} final hidden states differ from {a_name} at T={T} ({compute}): "
                       f"rms(diff)/rms {c['rel_rms_diff']}")

    # ------------------------------------------------------------------ main
    def run(self) -> None:
        import torch

        d, a = self.d, self.args
        pat = self.pattern_info()
        d.log(f"bench_verify: {self.cfg.name} on {self.hw['gpu']} x{d.world_size}; per forward {pat['n_allreduce']} "
              f"all-reduces, {pat['n_fused']} fused on the sm120 path ({pat['n_plain']} plain at "
              f"{', '.join(pat['plain_allreduce_sites'])}); T = {a.tokens}; compute {a.compute}")
        if self.shared:
            self.notes["shared_gpu"] = (
                f"CORRECTNESS RUN: {d.world_size} ranks share {torch.cuda.device_count()} GPU(s), every group on gloo; "
                "timings mean nothing. nccl and sglang_off are not run (NCCL refuses two ranks on one GPU, gloo "
                "cannot be captured); sglang_on is compared with sm120 driven directly.")
        self.norm, rejected = norms.select_norm_kernel(d, self.cfg.hidden_size, self.cfg.rms_norm_eps,
                                                         prefer=a.norm_kernel)
        self.notes["norm_kernels_rejected"] = [{"kernel": k, "reason": r} for k, r in rejected]
        d.log(f"  add+RMSNorm kernel (NCCL path and plain all-reduces): {self.norm.name}")
        comms = {}
        if "nccl" in a.backends:
            comms["nccl"] = NcclComm(d, self.norm)
        if nccl_mode.NCCL_NO_P2P in a.backends:
            comms[nccl_mode.NCCL_NO_P2P] = NcclNoP2pComm(d, self.norm)
        impls = []
        for name in OURS_BACKENDS:
            if name in a.backends:
                impl = self._setup_ours(name, max(a.tokens))
                if impl is not None:
                    impls.append(impl)
                    comms[name] = Sm120Comm(d, self.norm, impl, name=name)
        if self.no_p2p:
            nccl_mode.collect_nccl_transports(d, self.nccl_mode)
        self.write()
        try:
            for compute in a.compute:
                self._run_compute(compute, comms)
            if a.via_sglang:
                self._run_via_sglang()
            self.complete = True
        except run.Abort as e:
            self.notes["aborted"] = str(e)
            d.log(f"ABORTED: {e}")
        finally:
            for impl in impls:
                torch.cuda.synchronize()
                impl.close()
        if self.no_p2p:
            nccl_mode.collect_nccl_transports(d, self.nccl_mode)
        self.write()
        if d.is_main:
            self.print_tables()
            if not a.no_plot:
                self.plot()

    def _setup_ours(self, name: str, max_tokens: int):
        from benchmarks.peers import Skip, make_impl

        a = self.args
        impl = make_impl(name, a)
        try:
            impl.setup(self.d, max_tokens * self.cfg.hidden_size)
        except Skip as e:
            self.skip(name, str(e))
            return None
        self.notes[name] = impl.notes()
        return impl

    def _make_model(self, compute: str):
        a = self.args
        ok, model, why = self.d.attempt(
            lambda: Model(self.cfg, self.d, compute == "gemm", max(a.tokens), a.seed, a.max_expert_gib),
            f"model weights ({compute})")
        if not ok:
            self.skip("all", why, compute=compute)
            return None
        if model.notes:
            self.notes[f"model_{compute}"] = model.notes
        return model

    def _run_compute(self, compute: str, comms: dict) -> None:
        import torch

        d, a = self.d, self.args
        model = self._make_model(compute)
        if model is None:
            return
        for T in a.tokens:
            model.prepare_tokens(T)
            timed = {}
            for name, comm in comms.items():
                t = self.time_forward(model, comm, compute, T)
                if t is not None:
                    timed[name] = t
            base = None
            if compute == "gemm" and timed:
                base = self.time_forward(model, ComputeOnly(d, self.norm), compute, T)
                if base is not None:
                    self.record("none", compute, T, base, None)
            for name, t in timed.items():
                comm_us = t["median_us"] if compute == "none" else (
                    t["median_us"] - base["median_us"] if base is not None else None)
                self.record(name, compute, T, t, comm_us)
            ref = self.ref
            if ref in timed:
                if a.via_sglang:
                    self.finals[(compute, T)] = timed[ref]["final"]
                for name, t in timed.items():
                    if name != ref:
                        self.compare(compute, T, ref, timed[ref]["final"], name, t["final"])
            self._log_row(compute, T)
            timed = base = None
            torch.cuda.synchronize()
            self.write()
        del model
        torch.cuda.empty_cache()

    def _log_row(self, compute, T) -> None:
        rs = {r["backend"]: r for r in self.results if r["compute"] == compute and r["tokens"] == T}
        parts = [f"{b} {r['step_us']:.1f} us" + (f" (comm {r['comm_us']:.1f})" if r["comm_us"] is not None else "")
                 for b, r in rs.items()]
        self.d.log(f"  [{compute}] T={T:<3} " + "; ".join(parts))

    # ------------------------------------------------------------------ --via-sglang
    def _run_via_sglang(self) -> None:
        d = self.d
        if self.shared:
            # sglang_on routes by the seeds, from a cache of this run alone: without a measured table a group sends
            # every size to NCCL, which is gloo here, and a gloo all-reduce cannot be captured. Set before SGLang
            # reads its server args.
            self._cache = tempfile.TemporaryDirectory(prefix="bench_verify_cache_")
            os.environ.update(SGLANG_SM120_ALLREDUCE_TUNE="off", SGLANG_SM120_CACHE=self._cache.name)
        standin = sglang_compat.install_sglang_standins()
        if standin:
            self.notes["sglang_standins"] = standin
        ok, ps, why = d.attempt(lambda: __import__("sglang.srt.distributed.parallel_state", fromlist=["x"]),
                                "import sglang parallel_state")
        if not ok:
            self.skip("sglang", why)
            return
        ok, _, why = d.attempt(lambda: sglang_compat.publish_for_benchmark(d.world_size, d.rank, d.local_rank),
                               f"publish the scheduler's server args (sglang {sglang_compat.sglang_version()})")
        if not ok:
            self.skip("sglang", why)
            return
        if self.shared:
            ok, patches, why = d.attempt(lambda: _shared_gpu_patches(ps, d.rank), "shared-GPU patches")
            if not ok:
                self.skip("sglang", why)
                return
            self.notes["sglang_shared_gpu_patches"] = patches
        ok, _, why = d.attempt(lambda: ps.init_distributed_environment(
            world_size=d.world_size, rank=d.rank, distributed_init_method="env://", local_rank=d.local_rank,
            backend="gloo" if self.shared else "nccl"), "sglang init_distributed_environment")
        if not ok:
            self.skip("sglang", why)
            return
        for overlay_on in (False, True):
            name = "sglang_on" if overlay_on else "sglang_off"
            if self.shared and not overlay_on:
                self.skip(name, "--shared-gpu: SGLang's own all-reduce is gloo here, which a CUDA graph cannot capture")
                continue
            try:
                self._sglang_phase(ps, name, overlay_on)
            except run.Abort:
                raise
            except Exception as e:  # noqa: BLE001 - a phase that fails on every rank alike
                self.skip(name, short_exc(e))
        self.write()

    def _sglang_phase(self, ps, name: str, overlay_on: bool) -> None:
        import torch

        d, a = self.d, self.args
        os.environ["SGLANG_SM120_ALLREDUCE"] = "on" if overlay_on else "off"
        os.environ["SGLANG_SM120_ALLREDUCE_MAX_BYTES"] = str(max(a.tokens) * self.cfg.bytes_per_token)
        plugin = None
        if overlay_on:
            ok, plugin, why = d.attempt(lambda: _activate_overlay(), "sglang_sm120.plugin.activate")
            if not ok:
                self.skip(name, why)
                return
        try:
            d.attempt(lambda: ps.set_custom_all_reduce(a.sglang_custom_ar == "on"), "set_custom_all_reduce")
            ok, _, why = d.attempt(lambda: sglang_compat.initialize_tp(ps, d.world_size), "initialize_model_parallel")
            if not ok:
                self.skip(name, why)
                return
            try:
                info = {"backend": name, "custom_all_reduce": a.sglang_custom_ar}
                if overlay_on:
                    ok, desc, why = d.attempt(lambda: _prepare_overlay_backend(self.cfg.hidden_size), "prepare backend")
                    info["overlay"] = desc if ok else why
                    warning = all_nccl_warning(name, desc) if ok else None
                    if warning:
                        self.notes[f"{name}_routes"] = warning
                        d.log(f"WARNING: {warning}")
                ok, val, why = d.attempt(lambda: self._sglang_objects(ps), "RMSNorm / fusion gate")
                if not ok:
                    self.skip(name, why)
                    return
                tp, norm_module, gate, module_norm_ok, note = val
                info["norm"] = note
                comm = SglangComm(d, self.norm, name, tp, norm_module, gate, module_norm_ok)
                for compute in a.compute:
                    model = self._make_model(compute)
                    if model is None:
                        continue
                    norm_module.weight.data.copy_(model.norm_w)
                    for T in a.tokens:
                        model.prepare_tokens(T)
                        with ps.graph_capture() as gctx:
                            t = self.time_forward(model, comm, compute, T, stream=gctx.stream, label=name)
                        if t is None:
                            continue
                        base = [r for r in self.results if r["backend"] == "none" and r["compute"] == compute
                                and r["tokens"] == T]
                        comm_us = t["median_us"] if compute == "none" else (
                            t["median_us"] - base[0]["step_us"] if base else None)
                        self.record(name, compute, T, t, comm_us, fusion_gate=comm.gate_says(T))
                        ref = self.finals.get((compute, T))
                        if ref is not None:
                            self.compare(compute, T, self.ref, ref, name, t["final"])
                        self._log_row(compute, T)
                    del model
                    torch.cuda.empty_cache()
                if overlay_on:
                    ok, desc, _ = d.attempt(lambda: _describe_overlay(), "describe")
                    info["overlay_after"] = desc
                info["gate"] = {str(k): v for k, v in comm.gate_answers.items()}
                self.sglang_info.append(info)
            finally:
                torch.cuda.synchronize()
                d.attempt(lambda: ps.destroy_model_parallel(), "destroy_model_parallel")
        finally:
            if overlay_on and plugin is not None:
                d.attempt(lambda: plugin.deactivate(), "deactivate")

    def _sglang_objects(self, ps):
        import torch
        from sglang.srt.layers.layernorm import RMSNorm

        tp = ps.get_tp_group()
        norm_module = RMSNorm(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps).to(device=self.d.device,
                                                                                  dtype=torch.bfloat16)
        # Does SGLang's own unfused norm run here (real sgl_kernel), or is it a stand-in?
        module_norm_ok, note = True, "RMSNorm.forward (SGLang's own kernel)"
        try:
            x = torch.randn(2, self.cfg.hidden_size, device=self.d.device, dtype=torch.bfloat16)
            r = torch.randn_like(x)
            ref_n, ref_r = norms.reference_add_rmsnorm(x, r, norm_module.weight.data, self.cfg.rms_norm_eps)
            n, rr = norm_module.forward(x.clone(), r.clone())
            torch.cuda.synchronize()
            if not torch.allclose(n.float(), ref_n.float(), rtol=1 / 32, atol=1 / 32):
                raise RuntimeError("wrong result")
        except Exception as e:  # noqa: BLE001
            module_norm_ok = False
            note = f"RMSNorm.forward unusable here ({short_exc(e, 160)}); unfused norms use {self.norm.name}"
        # Identical on every rank: take rank 0's verdict if the ranks disagree (they should not).
        verdict = self.d.all_gather_obj(module_norm_ok)
        module_norm_ok = all(verdict)
        return tp, norm_module, sglang_compat.fusion_gate(), module_norm_ok, note

    # ------------------------------------------------------------------ reporting
    def print_tables(self) -> None:
        doc = self.doc()
        pat = doc["pattern"]
        if self.shared:
            io.table_print(f"\n{self.notes['shared_gpu']}")
        for compute in ("none", "gemm"):
            rs = [r for r in doc["results"] if r["compute"] == compute]
            if not rs:
                continue
            backends = io.iter_unique(r["backend"] for r in rs)
            p2p = " (NCCL with P2P disabled)" if self.no_p2p else ""
            io.table_print(f"\n== {self.cfg.name}, TP={self.d.world_size}, compute={compute}{p2p}: one verify "
                  f"forward ({pat['n_allreduce']} all-reduces; ours fuses {pat['n_fused']}); us, median of slowest "
                  f"rank; speed-up = {self.ref} / {self.ours}")
            w = max([16] + [len(b) + 7 for b in backends])  # column width: the longest "<backend> step" + 2
            hdr = f"{'T':>4} {'bytes/AR':>9} " + "".join(f"{b + ' step':>{w}}" for b in backends)
            hdr += "".join(f"{b + ' comm':>{w}}" for b in backends if b != "none")
            hdr += f"{'speed-up':>10}{'comm x':>8}"
            io.table_print(hdr)
            for T in sorted({r["tokens"] for r in rs}):
                cells = {r["backend"]: r for r in rs if r["tokens"] == T}
                line = f"{T:>4} {io.format_bytes(T * self.cfg.bytes_per_token):>9} "
                line += "".join(f"{cells[b]['step_us']:>{w}.1f}" if b in cells else f"{'-':>{w}}" for b in backends)
                for b in backends:
                    if b == "none":
                        continue
                    c = cells.get(b, {}).get("comm_us")
                    line += f"{c:>{w}.1f}" if c is not None else f"{'-':>{w}}"
                n, s = cells.get(self.ref), cells.get(self.ours)
                sp = io.ratio(n["step_us"], s["step_us"]) if n and s else None
                cr = io.ratio(n["comm_us"], s["comm_us"]) if n and s and n["comm_us"] and s["comm_us"] else None
                line += f"{sp:>9.2f}x" if sp else f"{'-':>10}"
                line += f"{cr:>7.2f}x" if cr else f"{'-':>8}"
                io.table_print(line)
        bad = [c for c in doc["checks"] if not c["ok"]]
        worst = [(c["backend"], c["compute"], c["tokens"]) for c in bad]
        io.table_print(f"\nfinal hidden states vs {self.ref}: {len(doc['checks']) - len(bad)}/{len(doc['checks'])} "
                           "within "
              f"rms(diff) <= {FINAL_REL_TOL:g} x rms" + (f"; OUT OF TOLERANCE: {worst}" if bad else ""))
        nonbit = [(r["backend"], r["compute"], r["tokens"]) for r in doc["results"]
                  if r["bitwise_across_ranks"] is False]
        io.table_print("bitwise identical across ranks: " + ("all" if not nonbit else f"NOT for {nonbit}"))
        for e in doc["e2e_estimate"]:
            io.table_print(f"ESTIMATE (not measured): T={e['tokens']}, compute {e['compute_ms']:g} ms + "
                               "measured comm: "
                  f"step {e['step_ms_nccl']:.2f} -> {e['step_ms_ours']:.2f} ms ({e['step_speedup']:.2f}x); "
                  f"accept_len {e['accept_len']:.2f} ({e['accept_len_source']}): {e['tok_s_nccl']:.1f} -> "
                  f"{e['tok_s_ours']:.1f} tok/s (no speculation: {e['tok_s_nospec']:g} tok/s)")
        if doc.get("nccl_setup"):
            io.table_print(nccl_mode.nccl_setup_line(doc["nccl_setup"]))
        if doc["skipped"]:
            io.table_print("skipped:")
            for s in doc["skipped"]:
                io.table_print(f"  {s['impl']}: {s['reason']}")
        io.table_print(f"wrote {self.out_json}")

    def plot(self) -> None:
        doc = self.doc()
        panels = []
        for compute in ("none", "gemm"):
            rs = [r for r in doc["results"] if r["compute"] == compute]
            if not rs:
                continue
            series = {}
            for b in io.iter_unique(r["backend"] for r in rs):
                pts = sorted((r["tokens"], r["step_us"]) for r in rs if r["backend"] == b)
                series["compute only" if b == "none" else b] = ([p[0] for p in pts], [p[1] / 1000 for p in pts])
            panels.append({"title": f"compute={compute}", "xlabel": "T (tokens per verify forward)",
                           "ylabel": "verify step (ms, median of slowest rank)", "logx": 2, "logy": False,
                           "series": series})
        if panels:
            p2p = ", NCCL with P2P disabled" if self.no_p2p else ""
            err = io.plot_lines(self.out_json.with_suffix(".png"), panels,
                                    title=f"{self.cfg.name} verify forward, {self.hw['gpu']} x{self.d.world_size}{p2p}")
            print(f"plot: {err or self.out_json.with_suffix('.png')}")


def _activate_overlay():
    import importlib

    plugin = importlib.import_module("sglang_sm120.plugin")
    plugin.activate()
    return plugin


def _prepare_overlay_backend(hidden: int) -> dict:
    import importlib

    import torch

    hd = importlib.import_module("sglang_sm120.hooks.distributed")
    comm = hd.prepare_tp_backend(hd.runtime_server_args(), hidden, torch.bfloat16)
    return comm.describe() if comm is not None else {"active": False, "reason": "no sm120 communicator on the TP group"}


def all_nccl_warning(name: str, overlay: dict) -> str | None:
    """What to warn of when the overlay's group routes every size to NCCL (an untuned box): the phase's rows then
    measure NCCL, not our kernels."""
    from sglang_sm120.routing.book import ALL_NCCL

    routes = overlay.get("routes") or {}
    if routes.get("source") != ALL_NCCL:
        return None
    return (f"{name} sends every size to NCCL ({routes.get('why')}): its rows measure NCCL under the overlay, not "
            "our kernels; tune first (python -m sglang_sm120.tune)")


def _describe_overlay() -> dict:
    import importlib

    hd = importlib.import_module("sglang_sm120.hooks.distributed")
    comm = hd.tp_backend()
    return comm.describe() if comm is not None else {"active": False}


def init_shared_gpu(script: str) -> ranks.Dist:
    """--shared-gpu: rank r on GPU LOCAL_RANK % count, torch's default group on gloo (no NCCL anywhere)."""
    import datetime

    import torch
    import torch.distributed as dist

    if ranks.world_size_from_env() < 2 or not torch.cuda.is_available():
        print(f"{script} --shared-gpu: needs >= 2 ranks (torchrun --nproc-per-node N) and a CUDA GPU. No numbers "
              "were produced.", file=sys.stderr, flush=True)
        raise ranks.NotEnoughGPUs(2)
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1800))
    return ranks.Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local,
                      device=torch.device("cuda", local), gloo=gloo, nccl=None)


def _shared_gpu_patches(ps, rank: int) -> list[str]:
    """SGLang's groups without pynccl or its own custom all-reduces (they open NCCL / IPC of their own, which
    two ranks on one GPU refuse): the GPU test harness's patches, in this process only."""
    from tests.gpu.sglang_harness import patch_groups_for_shared_gpus

    return patch_groups_for_shared_gpus(ps, rank)


def main(argv=None) -> int:
    args = parse_args(argv)
    uses_nccl = not args.shared_gpu and (args.via_sglang or bool({"nccl", nccl_mode.NCCL_NO_P2P} & set(args.backends)))
    return run.main("benchmarks/bench_verify.py", args, uses_nccl, Bench, in_process=argv is not None,
                    init=init_shared_gpu if args.shared_gpu else None)


if __name__ == "__main__":
    sys.exit(main())
