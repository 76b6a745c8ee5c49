"""A real `python -m sglang.launch_server` with the backend on: TP=2, both ranks on one GPU, a seeded random
Kimi-K2.5 (`KimiK25ForConditionalGeneration`, tests/gpu/kimi_shaped_model.py) with an EAGLE-3 draft, on the
installed SGLang release (0.5.13.post1 or 0.5.23; scripts/gpu_suite.sh runs each).

Three servers, the same settings but these:
- "off, eager":   --sm120-allreduce off, --disable-cuda-graph (SGLang's own all-reduce; the reference)
- "on, eager":    --sm120-allreduce on (an H200 is not capability 12.0), --disable-cuda-graph (the graph run's
                  largest batch still given, so both "on" runs have one byte bound)
- "on, graphs":   --sm120-allreduce on, CUDA graphs (batch sizes 1, 2, 4) for the target and the draft
each with the launch README gives (EAGLE-3, 3 steps, top-k 1, 4 draft tokens, --trust-remote-code, the default
--sm120-allreduce-tune: the launcher tunes before the ranks start). The two "on" servers share one backend cache:
the first launcher measures the table, the second finds it (a second launch on the same box), so both route every
size alike. By default "off" and "on, graphs" start at once and "on, eager" once the table exists
(SERVERS_AT_ONCE, below); SGL_SM120_SERVER_SEQUENTIAL=1 starts them one after the other.

Test-side only, each logged by the process that applies it (nothing of it is in the overlay):
tests/gpu/server_patches.py (every rank on GPU 0, SGLang's groups on gloo, the captured all-gather as a zero-padded
all-reduce, the launcher's tune with its ranks sharing GPU 0 and NCCL's time injected; and the test's instruments:
teacher forcing of every target row, a per-kind device counter of our calls, the negative controls' faults, one
line per model-runner forward), a stand-in `flashinfer` package (SGLang imports it at module
import; every call raises, and these settings keep SGLang off it: Triton attention, PyTorch sampling, FlashInfer's
all-reduce fusion disabled), `--grammar-backend none` (no request here is constrained), and
SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (two ranks on one GPU see each other's memory). SGLang turns piecewise
CUDA graphs off for a multimodal model itself, as for the users' Kimi-K2.5.

Every server is teacher-forced (server_patches.force_rows): each target row's argmax is made a fixed successor of
its input token, so every server generates the same tokens and each verify forward's first row is computed from
the same prefix on every server. What is checked (the verdicts and every number are also written to
$SGLANG_SM120_SERVER_TEST_OUT/server_test.json):
- on: rank 0's ENABLED line, routing by the table the launcher's tune measured (one server) or found (the
  other), one table file for both, `/get_server_info` reports the backend active; off: no ENABLED line, not
  active; every output token the forced one (the forcing held);
- per eager target-verify forward of "on, eager": the fused and plain calls equal
  benchmarks/workloads/verify_pattern.verify_counts for this model and release, no call fell back (the fused count
  holds only if the MoE sums deferred into the next layer's fused norm: nothing else makes fused calls), counted
  by the backend and on the device alike; every draft forward 3 plain calls, each to ours or NCCL as the table
  routes its size;
- per target-verify graph replay of "on, graphs": the same fused and plain calls, counted on the device (a captured
  call runs at every replay, where the backend's Python counters saw it once), its logits all-gather through our
  kernel, and the kernels' own device call counter moved by all of them;
- on against off, per prompt (LOGPROB_*, CAPTURE_*, below): the teacher-forced input logprobs of the prefill; the
  teacher-forced logprobs of the verify forwards (each one's first row, and the prefill's last); the unforced
  argmax of those rows wherever off's leads clearly; the EAGLE-3 captures of every verify forward (a digest of its
  first row, server_patches.capture_digest). On, eager against on, graphs: identical on 0.5.13.post1, within the
  same bounds on 0.5.23 (whose graph server prefills through another attention form and pads prefills to the
  captured sizes);
- negative controls (NEGATIVE_CONTROLS, below), on the two eager servers after the prompts: a prompt marked with
  a fault's word arms that fault on "on, eager" (server_patches: a verify forward whose fused calls sum nothing;
  on 0.5.13.post1 also the capture guard lifted), and the checks above, applied to that prompt against "off,
  eager", must fail where the fault says;
- the GPU-side call counter grows across requests; the graph run captured its graphs;
- EAGLE-3 verified drafts on every run (`spec_verify_ct`); on 0.5.13.post1 the overlay's guard named the layers
  feeding the draft's captures on both ranks. A random draft proposes nothing the random (and forced) target
  accepts (`spec_accepted_drafts` is recorded), so acceptance cannot show a wrong capture here: the digests do;
- `sglang.bench_one_batch_server` runs against the graph server (its times mean nothing on a shared GPU).

Run on the GPU machine: `OUT=... SGL_RELEASES=0.5.23 bash scripts/gpu_suite.sh build sglang-server` (installs that
release's .sgls carry of scripts/pack_sglang_server.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.workloads import verify_pattern as vp  # noqa: E402
from tests.gpu import server_patches as sp  # noqa: E402
from tests.gpu.kimi_shaped_model import HIDDEN, VOCAB  # noqa: E402

RELEASES = vp.RELEASES
# The default tune setting (auto): the launcher runs the tune before the ranks start and the ranks route by the
# table it measured. On one GPU NCCL cannot run two ranks, so the test-side patches run that tune with the ranks
# sharing the GPU and NCCL's time injected (server_patches: its routes mean nothing, its plumbing is the product's).
TUNE_ARGS: list[str] = []
# Three servers at once on the one GPU, safe because:
# KV pools are capped by --max-total-tokens, so --mem-fraction-static only bounds what SGLang's start-up memory
# check subtracts; JIT builds lock their cache folder; ports are each server's own.
SERVERS_AT_ONCE = os.environ.get("SGL_SM120_SERVER_SEQUENTIAL") != "1"
START_TIMEOUT_S = float(os.environ.get("SGL_SM120_SERVER_START_TIMEOUT_S", "480"))
REQUEST_TIMEOUT_S = 180.0
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]
GRAPH_BS = ["1", "2", "4"]
NEW_TOKENS = 24
RUNS = (("off, eager", "off", False), ("on, eager", "on", False), ("on, graphs", "on", True))
# Teacher-forced logprobs, on against off, per prompt: the prefill's input logprobs, and the verify forwards'
# (each one's first row, and the prefill's last row). The backend's fused op rounds the residual once where
# SGLang's path (all-reduce, then fused_add_rmsnorm) rounds the sum and then the residual: one bf16 rounding (2^-8
# relative) more or less per layer boundary, 19 boundaries deep here (9 before). That moves a typical logprob by
# a few hundredths of a nat; where two experts' sigmoid scores nearly tie the perturbation flips one of the top-8
# and that position moves by up to a nat or two (the 5-layer top-2 model on 1x H200: median 0.02-0.03, 1-2 of
# 23-47 positions at 0.3-1.6; this model's prefills on 1x H200, pooled over the prompts: median 0.02-0.03, the
# largest 0.08-0.13, none beyond 0.25 of 37). An all-reduce that dropped a rank's shard or counted one twice
# changes every position's hidden state by half or more (the shards differ: the checkpoint is random, not dummy),
# so the median moves by whole nats. Per prompt, not pooled: a fault at one prompt's sizes moves all of that
# prompt's positions, which its own median shows however few they are, where a pooled median would not move. Each
# prompt may have one position, or LOGPROB_OUTLIER_SHARE of them, beyond LOGPROB_OUTLIER_NATS.
LOGPROB_MEDIAN_TOL = 0.1
LOGPROB_OUTLIER_NATS = 0.25
LOGPROB_OUTLIER_SHARE = 0.2
# Captures, on against off, per prompt over every verify forward (teacher-forced: all compare): the relative
# error of the first row, estimated from the digests (rms of the projection differences over the rms of "off").
# The residual stream at a capture carries at most 2 x 6 boundaries' roundings, partly cancelling, and a flipped
# expert moves one forward's capture by up to tens of percent: on 1x H200, both releases, the median was
# 0.016-0.017 with the largest 0.13 and 1 of 21-31 forwards beyond 0.1. That is the spread to set the bound by:
# two servers of the same settings compute bit for bit alike (deterministic kernels at the same shapes; on,
# eager and on, graphs were identical on 0.5.13.post1), so off against off has no spread to scale from. The
# median bound is three times the measured median. A capture that read a partial sum is off by the other rank's
# share of a MoE output, every forward: rms about 0.6 in this checkpoint (one MoE block at its initialisation,
# on CPU) against captures of rms 2.0-2.9 (the digests), so 0.2-0.3, four to six times the bound; the
# negative control "capture_guard_off" measures it in every 0.5.13.post1 run.
CAPTURE_MEDIAN_TOL = 0.05
CAPTURE_OUTLIER_REL = 0.15
CAPTURE_OUTLIER_SHARE = 0.2
# The negative controls (server_patches.FAULT_WORDS), each a prompt marked with the fault's word, sent to both
# eager servers after the prompts: what the fault does on "on, eager", and the per-prompt checks of that prompt
# against "off, eager" that must fail. A sum that never happened at the verify size leaves the prefill's logprobs
# alone and the dispatch counted as ever (only the kernels' own counter misses those calls): the verify forwards'
# numbers show it. A lifted capture guard leaves every logprob alone (the deferred sum still reaches the next
# norm): only the captures and the counts show it.
NEGATIVE_CONTROLS = {
    "shard_at_verify": ("every fused call of a verify forward sums nothing (each rank keeps its own shard)",
                        ("verify logprobs", "captures")),
    "capture_guard_off": ("the MLP all-reduce of the layers feeding EAGLE-3's captures deferred into the next "
                          "layer's norm, so the captures read partial sums", ("captures", "counts")),
}
# Prompts of 5 to 16 words: within the graph run's bound (4 requests x 4 draft tokens = 16 rows), so every
# prefill, draft and verify all-reduce of both "on" runs goes to the same kernels, and eager against graphs
# compares like with like (a longer prefill would go to SGLang's path in the graph run only).
PROMPT_WORDS = (5, 8, 12, 16)
# What the tune prints when it wrote a table, or found one of this box and measured nothing.
TABLE_LINES = ("written to ", "a routing table of this box exists")
PROMPTS = [" ".join(f"w{(7 * i + 13 * j) % 1000}" for j in range(n)) for i, n in enumerate(PROMPT_WORDS)]


def negative_controls(release: str) -> list[str]:
    """The faults sent on `release`. 0.5.23 captures after the fused input kernel completed the owed sum
    (seams/v0_5_23.py): no guard there to lift."""
    return ["shard_at_verify"] + (["capture_guard_off"] if release == "0.5.13.post1" else [])


def negative_prompt(fault: str) -> str:
    return f"{sp.FAULT_WORDS[fault]} {PROMPTS[1]}"


def installed_release() -> str | None:
    return importlib.metadata.version("sglang") if importlib.util.find_spec("sglang") else None


def _why_not() -> str | None:
    release = installed_release()
    if release is None:
        return "sglang is not installed (the .sgls carry: scripts/pack_sglang_server.py)"
    if release not in RELEASES:
        return f"the real-server test knows SGLang {', '.join(RELEASES)}; this is {release}"
    if importlib.util.find_spec("sgl_kernel") is None:
        return "needs the real sgl_kernel (sglang-kernel 0.4.3, the .sgls carry)"
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")]


def launch_args(release: str, model: dict, *, port: int, nccl_port: int, mode: str, graphs: bool) -> list[str]:
    """The server's command line on `release` (0.5.23 renamed the graph batch sizes)."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model["target"], "--trust-remote-code",
            "--tp-size", "2", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
            "--nccl-port", str(nccl_port), "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--enforce-disable-flashinfer-allreduce-fusion", "--disable-custom-all-reduce",
            "--mem-fraction-static", "0.3", "--max-total-tokens", "8192", "--max-running-requests", "4",
            "--random-seed", "0", "--log-level", "info", "--grammar-backend", "none",
            "--speculative-draft-model-path", model["draft"], *EAGLE, "--sm120-allreduce", mode, *TUNE_ARGS]
    # Both releases warm a Kimi-K2.5 server up with a chat request, which the random checkpoint (no chat
    # template, no vision tower weights of use) cannot answer; the test's own requests follow.
    args += ["--skip-server-warmup"]
    old = release == "0.5.13.post1"
    if not graphs:  # the graph run's batch bound, so both "on" runs serve the same sizes with the same table
        return args + ["--disable-cuda-graph", "--cuda-graph-max-bs" if old else "--cuda-graph-max-bs-decode",
                       GRAPH_BS[-1]]
    if not old:
        # 0.5.23 also captures prefill graphs (breakable: cut at attention), by default up to 8192 tokens. Within
        # the bound (16 tokens here) every all-reduce in them is ours; past it SGLang's, which is gloo on this
        # shared GPU and cannot be captured. So the prefill graphs stop at the bound, and ours run inside them.
        args += ["--cuda-graph-max-bs-prefill", str(int(GRAPH_BS[-1]) * int(EAGLE[EAGLE.index(
            "--speculative-num-draft-tokens") + 1]))]
    return args + ["--cuda-graph-bs" if old else "--cuda-graph-bs-decode", *GRAPH_BS]


def expected_counts(model: dict, release: str) -> dict:
    captures = vp.sglang_capture_layers(model["layers"], model["eagle_layer_ids"])
    return vp.verify_counts(model["layers"], model["first_k_dense"], captures, release)


# ---------------------------------------------------------------------------------------------------------
# the test's own site folder: the start-up patches (sitecustomize) and the plugins' entry points


def write_site(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    # Runs at interpreter start in every server process (the scheduler processes are spawned); hands on to a
    # sitecustomize further down the path, if the machine has one.
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write('''"""Written by tests/gpu/test_sglang_server.py: the start-up part of tests/gpu/server_patches.py."""
import os as _os
import sys as _sys

from tests.gpu.server_patches import startup as _startup

_startup()
_here = _os.path.dirname(_os.path.abspath(__file__))
for _entry in _sys.path:
    if _entry and _os.path.abspath(_entry) != _here:
        _candidate = _os.path.join(_entry, "sitecustomize.py")
        if _os.path.isfile(_candidate):
            exec(compile(open(_candidate).read(), _candidate, "exec"), {"__name__": "sitecustomize"})
            break
''')
    # The overlay's own entry point, as `pip install` of this repository registers it (the GPU machine runs the
    # checkout from PYTHONPATH, uninstalled), and the test-side plugin's.
    from sglang_sm120.core.version import __version__

    for dist_name, version, entry in (
            ("sglang_sm120", __version__, "sm120_allreduce = sglang_sm120.plugin:activate"),
            ("sglang_sm120_server_test", "0", "sm120_server_test = tests.gpu.server_patches:activate")):
        dist = os.path.join(folder, f"{dist_name}-{version}.dist-info")
        os.makedirs(dist, exist_ok=True)
        with open(os.path.join(dist, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {dist_name.replace('_', '-')}\nVersion: {version}\n")
        with open(os.path.join(dist, "entry_points.txt"), "w") as f:
            f.write(f"[sglang.srt.plugins]\n{entry}\n")
    return folder


def server_env(site: str) -> dict:
    """What every process of a server, and a client of SGLang's own run beside it, gets: the test's site first."""
    env = dict(os.environ)
    env.update({
        "SGLANG_SM120_SERVER_TEST_PATCHES": "1",
        "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
        # 0.5.23 asks sglang-kernel >= 0.4.9; the carried 0.4.3 has every op its path calls on torch 2.11
        "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
        "PYTHONPATH": os.pathsep.join([site, REPO, os.path.join(REPO, "python"), env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        # 0.5.23 sets it for a server that captures CUDA graphs and not for an eager one; a table is keyed by the
        # NCCL_* settings, and the two "on" servers must share one table (the one-table check)
        "NCCL_GRAPH_REGISTER": "0",
    })
    return env


_ports_given: set[int] = set()


def free_port() -> int:
    """A port this test has not handed out yet, it and its +10000 (SGLang 0.5.13.post1's gRPC port) free and both
    below the kernel's ephemeral range: a server binds its HTTP port only after the launcher's tune (minutes), and
    meanwhile the gloo connections of the servers already running take ephemeral ports, one of which took the
    HTTP port of a server once."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    top = low - 10000
    for port in range(max(1024, top - 10000) + os.getpid() % 500 * 13, top, 7):
        if port in _ports_given:
            continue
        if all(_bindable(p) for p in (port, port + 10000)):
            _ports_given.add(port)
            return port
    raise RuntimeError(f"no free port pair below the ephemeral range (which starts at {low})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------
# one server


class Server:
    def __init__(self, name: str, model: dict, site: str, workdir: str, *, mode: str, graphs: bool, logdir: str):
        self.name, self.mode, self.graphs = name, mode, graphs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tag = name.replace(", ", "_")
        self.log_path = os.path.join(logdir, f"server_{tag}.log")
        self.args = launch_args(installed_release(), model, port=self.port, nccl_port=free_port(), mode=mode,
                                graphs=graphs)
        env = server_env(site)
        # The two "on" servers share one backend cache, so both route by the table the first launcher measured
        # (their outputs compare only where they route alike); each server its own copy of the checkpoint's
        # remote-code processor module.
        env["SGLANG_SM120_CACHE"] = os.path.join(workdir, "cache_on" if mode == "on" else f"cache_{tag}")
        env["HF_MODULES_CACHE"] = os.path.join(workdir, f"hf_modules_{tag}")
        if not graphs:  # the negative controls' requests go to the eager servers (a graph replays what it captured)
            env[sp.FAULTS_ENV] = "1"
        self.env = env
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
                                     start_new_session=True)
        self.t0 = time.time()

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def forwards(self) -> list[dict]:
        return [json.loads(ln.split(sp.FORWARD_TAG, 1)[1]) for ln in self.text().splitlines() if sp.FORWARD_TAG in ln]

    def wait_for_table(self) -> None:
        """Until this server's launcher has a routing table (measured or found), it exits, or START_TIMEOUT_S."""
        while time.time() - self.t0 < START_TIMEOUT_S and self.proc.poll() is None:
            if any(ln.startswith(TABLE_LINES) for ln in self.text().splitlines()):
                return
            time.sleep(2)

    def wait_ready(self) -> float:
        while time.time() - self.t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode} while starting:\n"
                                     f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - self.t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        raise AssertionError(f"server {self.name} not ready after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self.log.close()


# ---------------------------------------------------------------------------------------------------------
# what a run records


def sm120_states(info: dict) -> list[dict]:
    return [s.get("sm120_allreduce") for s in info.get("internal_states", []) if "sm120_allreduce" in s]


def device_calls(server: Server) -> int:
    states = sm120_states(server.get("/get_server_info"))
    return sum(int(s.get("device_calls") or 0) for s in states)


def generate(server: Server, prompt: str) -> dict:
    seen, t0 = len(server.forwards()), time.time()
    out = server.post("/generate", {
        "text": prompt, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    meta = out["meta_info"]
    return {"text": out["text"], "wall_s": round(time.time() - t0, 2),
            "prompt_ids": [t[1] for t in meta["input_token_logprobs"]],
            "output_ids": [t[1] for t in meta["output_token_logprobs"]],
            "input_logprobs": [t[0] for t in meta["input_token_logprobs"]],
            "spec_verify_ct": meta.get("spec_verify_ct"),
            # drafts the target accepted (0.5.23 keeps only the first name)
            "spec_accepted_drafts": meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts")),
            "completion_tokens": meta.get("completion_tokens"),
            # the forwards it ran (requests go one at a time; the log has them before the answer is sent)
            "forwards": server.forwards()[seen:]}


def serve(server: Server, model: dict, workdir: str, faults: list[str]) -> dict:
    """Wait for `server`, send the prompts, then on an eager server each fault's prompt, read what it recorded, stop
    it."""
    record: dict = {"name": server.name, "mode": server.mode, "graphs": server.graphs, "log": server.log_path,
                    "args": server.args[3:]}
    try:
        record["start_s"] = round(server.wait_ready(), 1)
        record["info_before"] = sm120_states(server.get("/get_server_info"))
        calls = [device_calls(server)]
        record["requests"] = []
        for prompt in PROMPTS:
            record["requests"].append(generate(server, prompt))
            calls.append(device_calls(server))
        record["device_calls"] = calls
        record["info_after"] = sm120_states(server.get("/get_server_info"))
        if not server.graphs:
            record["negative_controls"] = {fault: generate(server, negative_prompt(fault)) for fault in faults}
        if server.graphs:
            record["bench_one_batch_server"] = bench_one_batch(server, model, workdir)
    finally:
        server.stop()
        text = server.text()
        record["enabled_lines"] = [ln for ln in text.splitlines() if "sm120 IPC all-reduce ENABLED" in ln]
        record["disabled_lines"] = [ln for ln in text.splitlines() if "sm120 IPC all-reduce DISABLED" in ln]
        record["patch_lines"] = sorted({re.sub(r"pid \d+", "pid N", ln) for ln in text.splitlines()
                                        if "[sm120 server-test patch" in ln})
        # 0.5.13.post1: "Capture cuda graph end."; 0.5.23: "Capture target verify CUDA graph end."
        record["graph_capture_lines"] = [ln for ln in text.splitlines()
                                         if re.search(r"capture .*cuda graph end", ln, re.IGNORECASE)]
        record["capture_guard_lines"] = [ln for ln in text.splitlines() if "feed aux hidden-state captures" in ln]
        record["tune_lines"] = [ln for ln in text.splitlines()
                                if ln.startswith(("sglang_sm120: routing table for", "tuning TP=") + TABLE_LINES)]
        record["tail"] = server.tail(40)
    return record


def bench_one_batch(server: Server, model: dict, workdir: str) -> dict:
    result = os.path.join(workdir, "bench_one_batch.jsonl")
    # random-ids: token ids drawn from the vocabulary. The default dataset ("random") samples its prompts from
    # ShareGPT, which it downloads from the Hugging Face Hub, and the GPU machine reaches no network.
    cmd = [sys.executable, "-m", "sglang.bench_one_batch_server", "--model-path", model["target"],
           "--base-url", server.url, "--batch-size", "1", "2", "--input-len", "64", "--output-len", "16",
           "--dataset-name", "random-ids", "--result-filename", result]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=workdir, env=server.env)
    return {"returncode": done.returncode, "stdout_tail": done.stdout[-3000:], "stderr_tail": done.stderr[-3000:],
            "results": open(result).read() if os.path.exists(result) else None}


# ---------------------------------------------------------------------------------------------------------
# the test


@pytest.fixture(scope="module")
def workdir():
    folder = tempfile.mkdtemp(prefix="sgl_sm120_server_")
    yield folder


def test_real_server_tp2_eagle3_on_against_off(workdir):
    out_dir = os.environ.get("SGLANG_SM120_SERVER_TEST_OUT", workdir)
    os.makedirs(out_dir, exist_ok=True)
    site = write_site(os.path.join(workdir, "site"))
    t0 = time.time()
    made = subprocess.run([sys.executable, "-m", "tests.gpu.kimi_shaped_model", os.path.join(workdir, "model"),
                           "--device", "cuda"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    model = json.loads(made.stdout.strip().splitlines()[-1])
    release = installed_release()
    report: dict = {"sglang": release, "model": model, "model_write_s": round(time.time() - t0, 1),
                    "expected_per_verify": expected_counts(model, release), "servers_at_once": SERVERS_AT_ONCE,
                    "negative_controls": negative_controls(release), "bounds": bounds(), "runs": {}, "checks": {}}
    runs = report["runs"]

    def save():
        with open(os.path.join(out_dir, "server_test.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    failures = []

    def check(name: str, ok: bool, detail) -> None:
        report["checks"][name] = {"ok": bool(ok), "detail": detail}
        if not ok:
            failures.append(f"{name}: {detail}")

    def start(name, mode, graphs):
        return Server(name, model, site, workdir, mode=mode, graphs=graphs, logdir=out_dir)

    servers = {}
    if SERVERS_AT_ONCE:
        # "on, graphs" measures the table, "on, eager" starts once it exists and finds it (a second launch on the
        # same box): one table for both, so every size goes the same way in both.
        for name, mode, graphs in sorted(RUNS, key=lambda run: run[0] == "on, eager"):
            if name == "on, eager":
                servers["on, graphs"].wait_for_table()
            servers[name] = start(name, mode, graphs)
    t_servers = time.time()
    try:
        for name, mode, graphs in RUNS:
            try:
                runs[name] = serve(servers.get(name) or start(name, mode, graphs), model, workdir,
                                   report["negative_controls"])
            except AssertionError as e:
                runs[name] = {"error": str(e)[-6000:]}
                check(f"{name}: started and answered", False, str(e)[-3000:])
            save()
        report["servers_s"] = round(time.time() - t_servers, 1)
        _judge(runs, check, report["expected_per_verify"], model, release)
    finally:
        for server in servers.values():
            if not server.log.closed:
                server.stop()
        save()
    assert not failures, "\n".join(failures)


def bounds() -> dict:
    return {"logprob_median_nats": LOGPROB_MEDIAN_TOL, "logprob_outlier_nats": LOGPROB_OUTLIER_NATS,
            "logprob_outlier_share": LOGPROB_OUTLIER_SHARE, "capture_median_rel": CAPTURE_MEDIAN_TOL,
            "capture_outlier_rel": CAPTURE_OUTLIER_REL, "capture_outlier_share": CAPTURE_OUTLIER_SHARE}


def _judge(runs: dict, check, expected: dict, model: dict, release: str) -> None:
    off, eager, graphs = runs.get("off, eager"), runs.get("on, eager"), runs.get("on, graphs")
    for name, run in runs.items():
        if "error" in run:
            continue
        on = run["mode"] == "on"
        check(f"{name}: ENABLED line on rank 0" if on else f"{name}: no ENABLED line",
              bool(run["enabled_lines"]) == on, run["enabled_lines"] or run["disabled_lines"])
        if on:
            check(f"{name}: the launcher's tune has a table (measured or found) and the ranks route by it",
                  any("routes: tuned table" in ln for ln in run["enabled_lines"])
                  and any(ln.startswith(TABLE_LINES) for ln in run["tune_lines"]),
                  {"tune": run["tune_lines"][-3:], "enabled": run["enabled_lines"]})
        states = run["info_after"]
        check(f"{name}: /get_server_info reports the backend {'active' if on else 'inactive'}",
              bool(states) and all(bool(s.get("active")) == on for s in states), states)
        check(f"{name}: EAGLE-3 verified drafts", all((r["spec_verify_ct"] or 0) > 0 for r in run["requests"]),
              [r["spec_verify_ct"] for r in run["requests"]])
        requests = run["requests"] + list((run.get("negative_controls") or {}).values())
        check(f"{name}: teacher forcing held: every output token the forced successor of the token before it",
              all(teacher_forced(r) for r in requests), [r["output_ids"][:4] for r in requests])
        if on and release == "0.5.13.post1":
            feeding = sorted(c - 1 for c in vp.sglang_capture_layers(model["layers"], model["eagle_layer_ids"]))
            guard = [ln for ln in run["capture_guard_lines"] if f"layers {feeding}" in ln]
            check(f"{name}: the layers feeding EAGLE-3's captures {feeding} keep their MLP all-reduce, on both ranks",
                  {"TP0", "TP1"} <= {t for ln in guard for t in ("TP0", "TP1") if t in ln}, run["capture_guard_lines"])
        if on:
            calls = run["device_calls"]
            check(f"{name}: the kernels' device call counter grows across requests",
                  all(b > a for a, b in zip(calls[:-1], calls[1:], strict=True)), calls)
    if eager and graphs and "error" not in eager and "error" not in graphs:
        on_runs = {"on, eager": eager, "on, graphs": graphs}
        paths = {s["routes"].get("path") for run in on_runs.values() for s in run["info_after"]}
        # each launcher's last word on its table: written (measured) or found
        said = {name: next((p for ln in reversed(run["tune_lines"]) for p in TABLE_LINES if ln.startswith(p)), None)
                for name, run in on_runs.items()}
        check("on, eager and on, graphs route by one table, measured by one launcher and found by the other",
              len(paths) == 1 and sorted(said.values(), key=str) == sorted(TABLE_LINES),
              {"tables": sorted(paths, key=str), "tune": said})
    if eager and "error" not in eager:
        _judge_counts(eager, check, expected)
    if graphs and "error" not in graphs:
        check("on, graphs: CUDA graphs captured", bool(graphs["graph_capture_lines"]), graphs["graph_capture_lines"])
        _judge_replays(graphs, check, expected)
        bench = graphs.get("bench_one_batch_server") or {}
        check("on, graphs: sglang.bench_one_batch_server ran", bench.get("returncode") == 0,
              {k: bench.get(k) for k in ("returncode", "stderr_tail")})
    if off and eager and "error" not in off and "error" not in eager:
        _judge_close(off, eager, check, "on against off", "off's")
        _judge_negative_controls(off, eager, check, expected, release)
    if eager and graphs and "error" not in eager and "error" not in graphs:
        if release == "0.5.13.post1":
            # One table, requests one at a time (batch 1 is captured: nothing padded), no prefill graphs: the
            # graph server computes what the eager one does, our kernels captured or not.
            numbers = [compare_prompt(r_e, r_g) for r_e, r_g in zip(eager["requests"], graphs["requests"],
                                                                     strict=True)]
            check("on, eager against on, graphs: identical teacher-forced logprobs (prefill and verify), unforced "
                  "argmax and EAGLE-3 captures, every prompt",
                  all(identical(n) for n in numbers), [largest(n) for n in numbers])
        else:
            # 0.5.23 computes differently with graphs, our kernels aside: its graph server prefills through MLA's
            # absorbed form ("Piecewise CUDA graph is enabled, use MLA for prefill"), the eager one through MHA, and
            # pads a prefill to the captured token counts. The same bounds as on against off then.
            _judge_close(eager, graphs, check, "on, graphs against on, eager", "eager's")


def teacher_forced(request: dict) -> bool:
    """Every output token is server_patches.forced_successor of the token before it (the prompt's last first)."""
    previous = request["prompt_ids"][-1]
    for token in request["output_ids"]:
        if token != sp.forced_successor(previous, VOCAB):
            return False
        previous = token
    return bool(request["output_ids"])


def verify_forwards(requests: list[dict], graph: bool | None = None) -> list[dict]:
    """The target-verify forwards of `requests`, those a graph ran (graph=True), those it did not (False), or all."""
    return [f for r in requests for f in r["forwards"] if not f["draft"] and f["mode"] == "TARGET_VERIFY"
            and (graph is None or f["graph"] == graph)]


def wanted_counts(expected: dict) -> tuple[dict, dict]:
    """What one verify forward moves: the backend's Python counters, and the device counters, eager."""
    plain, fused = expected["plain"], expected["fused"]
    return ({"sm120": plain, "sm120_fused": fused, "fallback": 0, "fused_fallback": 0},
            {"plain": plain, "fused": fused, "gather": 0, "kernel": plain + fused})


def wrong_counts(forwards: list[dict], expected: dict) -> list:
    want, want_device = wanted_counts(expected)
    return [(f["delta"], f.get("device")) for f in forwards if f["delta"] != want or f.get("device") != want_device]


def _judge_counts(eager: dict, check, expected: dict) -> None:
    """Every eager verify forward of the target: the rule's fused and plain calls, nothing fallen back (the tune
    measures every verify size), the backend's counters and the device's agreeing; every draft forward: its plain
    calls, each where the table routes its size (a size between two measured ones whose routes differ is NCCL's: a
    draft extend of a 5-token prompt)."""
    verify = verify_forwards(eager["requests"], graph=False)
    wrong = wrong_counts(verify, expected)
    want, want_device = wanted_counts(expected)
    check(f"on, eager: every target-verify forward made {expected['fused']} fused and {expected['plain']} plain "
          f"calls ({expected['moe_deferred']} MoE sums deferred into the next layer's fused norm), none fell back, "
          "counted alike by the backend and on the device",
          bool(verify) and not wrong, {"verify_forwards": len(verify), "want": want, "want_device": want_device,
                                       "wrong": wrong[:5]})
    forwards = [f for r in eager["requests"] for f in r["forwards"] if not f["graph"]]
    draft = [f for f in forwards if f["draft"] and f["tokens"]]
    ours = routed_to_ours(eager)
    wrong, nccl = [], set()
    for f in draft:
        n, to_ours = expected["draft_plain"], ours(f["tokens"] * HIDDEN * 2)
        if not to_ours:
            nccl.add(f["tokens"])
        want = {"sm120": n if to_ours else 0, "sm120_fused": 0, "fallback": 0 if to_ours else n, "fused_fallback": 0}
        if f["delta"] != want:
            wrong.append((f["mode"], f["tokens"], f["delta"], want))
    check(f"on, eager: every draft forward made {expected['draft_plain']} plain calls, each where the table routes it",
          bool(draft) and not wrong,
          {"draft_forwards": len(draft), "tokens_the_table_gives_nccl": sorted(nccl), "wrong": wrong[:5]})


def _judge_replays(graphs: dict, check, expected: dict) -> None:
    """Every verify forward of the graph server replays its graph, and each replay runs the rule's fused and plain
    calls on our kernels (counted on the device: the backend's Python counters saw each captured call once, at
    capture), the captured logits all-gather's pieces too, and the kernels' own counter moves by all of them."""
    plain, fused = expected["plain"], expected["fused"]

    def right(d: dict | None) -> bool:
        return (d is not None and d["plain"] == plain and d["fused"] == fused and d["gather"] >= 1
                and d["kernel"] == plain + fused + d["gather"])

    verify = verify_forwards(graphs["requests"])
    wrong = [(f["graph"], f.get("device")) for f in verify if not f["graph"] or not right(f.get("device"))]
    check(f"on, graphs: every target-verify forward replayed its CUDA graph, each replay {fused} fused and {plain} "
          "plain calls of ours and its logits all-gather through our kernel, counted on the device, the kernels' own "
          "device counter agreeing",
          bool(verify) and not wrong, {"verify_forwards": len(verify), "wrong": wrong[:5]})


def routed_to_ours(run: dict):
    """bytes -> whether the table the run's ranks route by gives a plain bf16 all-reduce of that size to ours."""
    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import lookup

    paths = {s["routes"].get("path") for s in run["info_after"]}
    assert len(paths) == 1 and None not in paths, f"the ranks route by one table file, not {paths}"
    loaded = cache.load_file(paths.pop())
    assert loaded.table is not None, f"{loaded.path}: {loaded.reason}"
    bound = min(s["max_bytes"] for s in run["info_after"])
    return lambda nbytes: nbytes <= bound and lookup(loaded.table, nbytes, "bfloat16", False) is not None


def capture_error(on: list, off: list) -> float:
    """The larger over the captures of the relative error of "on"'s first row against "off"'s, from two digests
    (server_patches.capture_digest)."""
    worst = 0.0
    for (_, *proj_on), (rms_off, *proj_off) in zip(on, off, strict=True):
        diff = (sum((a - b) ** 2 for a, b in zip(proj_on, proj_off, strict=True)) / len(proj_off)) ** 0.5
        worst = max(worst, diff / rms_off if rms_off > 0 else float("inf"))
    return worst


def forced_rows(request: dict) -> dict[int, dict]:
    """The target's teacher-forced rows of one request, by position: the prefill's last and each verify's first."""
    return {row["pos"]: row for f in request["forwards"] if not f["draft"] for row in f.get("forced") or ()}


def verify_captures(request: dict) -> dict[int, list]:
    """The capture digest of each verify forward of one request, by the position of its first row."""
    return {f["forced"][0]["pos"]: f["capture"] for f in verify_forwards([request])
            if f.get("forced") and f.get("capture") is not None}


def compare_prompt(ref: dict, run: dict) -> dict:
    """One prompt's numbers, `run`'s record of it against `ref`'s: |diff| of each input logprob and of each
    teacher-forced row's logprob, the rows where `ref`'s argmax leads by more than LOGPROB_OUTLIER_NATS and the
    two argmaxes part, each verify forward's capture error, and the rows or captures only one record has (a
    draft accepted in one run takes a verify's first row to another position there)."""
    ref_rows, run_rows = forced_rows(ref), forced_rows(run)
    ref_caps, run_caps = verify_captures(ref), verify_captures(run)
    rows, caps = sorted(set(ref_rows) & set(run_rows)), sorted(set(ref_caps) & set(run_caps))
    clear = [p for p in rows if ref_rows[p]["lead"] > LOGPROB_OUTLIER_NATS]
    return {"input": [abs(a - b) for a, b in zip(ref["input_logprobs"][1:], run["input_logprobs"][1:], strict=True)],
            "forced": [abs(ref_rows[p]["lp"] - run_rows[p]["lp"]) for p in rows],
            "clear_rows": len(clear), "argmax_parted": [p for p in clear if ref_rows[p]["top"] != run_rows[p]["top"]],
            "captures": [capture_error(run_caps[p], ref_caps[p]) for p in caps],
            "unmatched": len(set(ref_rows) ^ set(run_rows)) + len(set(ref_caps) ^ set(run_caps)),
            "accepted": int(ref.get("spec_accepted_drafts") or 0) + int(run.get("spec_accepted_drafts") or 0)}


def spread(diffs: list[float], median_tol: float, outlier: float, share: float) -> dict:
    """The median within `median_tol` and at most one, or `share`, of the values beyond `outlier`."""
    values = sorted(diffs)
    median = values[len(values) // 2] if values else None
    beyond = sum(v > outlier for v in values)
    return {"ok": bool(values) and median <= median_tol and beyond <= max(1, int(share * len(values))),
            "n": len(values), "median": median, "max": values[-1] if values else None, "beyond": beyond}


def prompt_verdicts(numbers: dict) -> dict[str, dict]:
    """The per-prompt checks of one prompt's numbers (compare_prompt)."""
    # an accepted draft leaves its run one position without a verify's first row: a row and a capture unmatched
    matched = numbers["unmatched"] <= 2 * numbers["accepted"]
    verdicts = {
        "input logprobs": spread(numbers["input"], LOGPROB_MEDIAN_TOL, LOGPROB_OUTLIER_NATS, LOGPROB_OUTLIER_SHARE),
        "verify logprobs": spread(numbers["forced"], LOGPROB_MEDIAN_TOL, LOGPROB_OUTLIER_NATS, LOGPROB_OUTLIER_SHARE),
        "argmax": {"ok": not numbers["argmax_parted"], "clear_rows": numbers["clear_rows"],
                   "parted_at": numbers["argmax_parted"]},
        "captures": spread(numbers["captures"], CAPTURE_MEDIAN_TOL, CAPTURE_OUTLIER_REL, CAPTURE_OUTLIER_SHARE),
    }
    for key in ("verify logprobs", "captures"):
        verdicts[key]["ok"] = verdicts[key]["ok"] and matched
        verdicts[key]["unmatched"] = numbers["unmatched"]
    return verdicts


def identical(numbers: dict) -> bool:
    return (bool(numbers["forced"]) and bool(numbers["captures"]) and not numbers["unmatched"]
            and not numbers["argmax_parted"]
            and all(v == 0 for k in ("input", "forced", "captures") for v in numbers[k]))


def largest(numbers: dict) -> dict:
    """The largest difference of each kind in one prompt's numbers, and how many rows compared."""
    return {"rows": len(numbers["forced"]), "unmatched": numbers["unmatched"],
            **{k: max(numbers[k], default=None) for k in ("input", "forced", "captures")}}


PER_PROMPT = (
    ("input logprobs", f"teacher-forced input logprobs of the prefill, median |diff| <= {LOGPROB_MEDIAN_TOL} and at "
                       f"most one position or {LOGPROB_OUTLIER_SHARE:.0%} beyond {LOGPROB_OUTLIER_NATS} nats"),
    ("verify logprobs", f"teacher-forced logprobs of the verify forwards (each one's first row, and the prefill's "
                        f"last), median |diff| <= {LOGPROB_MEDIAN_TOL} and at most one row or "
                        f"{LOGPROB_OUTLIER_SHARE:.0%} beyond {LOGPROB_OUTLIER_NATS} nats"),
    ("argmax", "the unforced argmax of those rows equal wherever {whose} leads by more than "
               f"{LOGPROB_OUTLIER_NATS} nats"),
    ("captures", f"EAGLE-3 captures of every verify forward, median relative error <= {CAPTURE_MEDIAN_TOL} and at "
                 f"most one or {CAPTURE_OUTLIER_SHARE:.0%} beyond {CAPTURE_OUTLIER_REL}"),
)


def _judge_close(ref: dict, run: dict, check, label: str, whose: str) -> None:
    """`run` against `ref`, two servers whose all-reduces round differently, prompt by prompt: each check holds for
    every prompt on its own."""
    verdicts = [prompt_verdicts(compare_prompt(r_ref, r_run))
                for r_ref, r_run in zip(ref["requests"], run["requests"], strict=True)]
    for key, title in PER_PROMPT:
        check(f"{label}, per prompt: {title.format(whose=whose)}", all(v[key]["ok"] for v in verdicts),
              [v[key] for v in verdicts])


def _judge_negative_controls(off: dict, eager: dict, check, expected: dict, release: str) -> None:
    """Each negative control's prompt on "on, eager" (the fault armed) against "off, eager": the per-prompt checks
    the fault names must fail (and the counts of its verify forwards, where it names them)."""
    for fault in negative_controls(release):
        what, must = NEGATIVE_CONTROLS[fault]
        ref, run = ((r.get("negative_controls") or {}).get(fault) for r in (off, eager))
        name = f"negative control {fault} ({what}): the test catches it by its {' and '.join(must)}"
        if ref is None or run is None:
            check(name, False, "its prompt was not answered by both eager servers")
            continue
        numbers = compare_prompt(ref, run)
        verdicts = prompt_verdicts(numbers)
        verify = verify_forwards([run])
        verdicts["counts"] = {"ok": not wrong_counts(verify, expected), "wrong": wrong_counts(verify, expected)[:3]}
        # caught by the numbers, not by their absence: every verify forward armed, every row and capture compared
        armed = bool(verify) and all(f.get("fault") == fault for f in verify)
        compared = bool(numbers["forced"]) and bool(numbers["captures"]) and not numbers["unmatched"]
        check(name, armed and compared and all(not verdicts[key]["ok"] for key in must),
              {"armed_on_every_verify_forward": armed, "compared": largest(numbers), **verdicts})
