"""A real `python -m sglang.launch_server` with the backend on: TP=2, both ranks on one GPU, a seeded random
Kimi-shaped DeepSeek-V3 model (tests/gpu/kimi_shaped_model.py) with an EAGLE-3 draft, on SGLang 0.5.13.post1.

Three servers, one after the other, the same settings but these:
- "off, eager":   --sm120-allreduce off, --disable-cuda-graph (SGLang's own all-reduce; the reference)
- "on, eager":    --sm120-allreduce on (an H200 is not capability 12.0), --disable-cuda-graph
- "on, graphs":   --sm120-allreduce on, CUDA graphs (batch sizes 1, 2, 4) for the target and the draft
each with EAGLE-3 (3 steps, top-k 1, 4 draft tokens) and `--sm120-allreduce-tune off` (the seeds: a start-up
tune would measure ranks time-slicing one GPU against gloo, which means nothing).

Test-side only, each logged by the process that applies it (nothing of it is in the overlay):
tests/gpu/server_patches.py (every rank on GPU 0, SGLang's groups on gloo, the captured all-gather as a zero-padded
all-reduce), a stand-in `flashinfer` package (SGLang imports it at module import; every call raises, and these
settings keep SGLang off it: Triton attention, PyTorch sampling, FlashInfer's all-reduce fusion disabled),
`--grammar-backend none` (xgrammar is not carried; no request here is constrained), and
SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (two ranks on one GPU see each other's memory). Piecewise CUDA graphs
are off: their compiled code calls the all-reduce through torch.compile, which the overlay stays out of.

What is checked (the verdicts and every number are also written to $SGL_SM120_SERVER_TEST_OUT/server_test.json):
- on: rank 0's ENABLED line, `/get_server_info` reports the backend active; off: no ENABLED line, not active;
- the fused all-reduce + residual + RMSNorm served the layer boundaries (Python counters, eager run) and the
  GPU-side call counter grows across requests in the graph run (replays run no Python);
- the graph run captured its graphs (SGLang's capture log line) and its captured logits all-gather went
  through our kernel (no gloo call can be captured: a capture that reached gloo would have failed the start);
- teacher-forced input logprobs of on against off (LOGPROB_MEDIAN_TOL, below); the first greedy tokens equal;
  on, eager and on, graphs identical;
- EAGLE-3 verified drafts on every run (`spec_verify_ct`); the overlay's guard named the layers feeding the
  draft's captures (1, 2, 3: the draft reads the hidden states before layers 2-4) on both ranks, so their MLP
  all-reduce is completed before a capture reads it. A random draft proposes nothing the random target accepts
  (`spec_accepted_drafts` is recorded, and 0), so acceptance cannot show a wrong capture here;
- `sglang.bench_one_batch_server` runs against the graph server (its times mean nothing on a shared GPU).

Run on the GPU machine: `OUT=... bash scripts/gpu_suite.sh build sglang-server` (installs the .sgls carry of
scripts/pack_sglang_server.py and points SGL_SM120_SERVER_SITE at it).
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
RELEASE = "0.5.13.post1"
START_TIMEOUT_S = float(os.environ.get("SGL_SM120_SERVER_START_TIMEOUT_S", "420"))
REQUEST_TIMEOUT_S = 120.0
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4"]
GRAPH_BS = ["1", "2", "4"]
NEW_TOKENS = 24
# Teacher-forced logprobs, on against off. The backend's fused op rounds the residual once where SGLang's path
# (all-reduce, then fused_add_rmsnorm) rounds the sum and then the residual: one bf16 rounding (2^-8 relative)
# more or less per layer boundary, 9 boundaries deep. That moves a typical logprob by a few hundredths of a
# nat; at the odd position where two experts' sigmoid scores nearly tie, the perturbation flips the top-2
# choice and that position moves by up to a nat or two (first run, 1x H200, 2026-12-02: median 0.02-0.03, one
# or two of 23-47 positions per prompt at 0.3-1.6). An all-reduce that dropped a rank's shard or counted one
# twice changes every position's hidden state by half or more (the shards differ: the checkpoint is random,
# not dummy), so the median moves by whole nats. Hence: median <= LOGPROB_MEDIAN_TOL, and at most
# LOGPROB_OUTLIER_SHARE of the positions beyond LOGPROB_OUTLIER_NATS.
LOGPROB_MEDIAN_TOL = 0.1
LOGPROB_OUTLIER_NATS = 0.25
LOGPROB_OUTLIER_SHARE = 0.1
# Prompts of 5 to 16 words: within the graph run's bound (4 requests x 4 draft tokens = 16 rows), so every
# prefill, draft and verify all-reduce of both "on" runs goes to the same kernels, and eager against graphs
# compares like with like (a longer prefill would go to SGLang's path in the graph run only).
PROMPT_WORDS = (5, 8, 12, 16)
PROMPTS = [" ".join(f"w{(7 * i + 13 * j) % 1000}" for j in range(n)) for i, n in enumerate(PROMPT_WORDS)]


def _why_not() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (the .sgls carry: scripts/pack_sglang_server.py)"
    version = importlib.metadata.version("sglang")
    if version != RELEASE:
        return f"the real-server test runs on SGLang {RELEASE} (its sglang-kernel fits torch 2.11); this is {version}"
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
        "PYTHONPATH": os.pathsep.join([site, REPO, os.path.join(REPO, "python"), env.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def free_port() -> int:
    """A free port below 55536: SGLang 0.5.13.post1 also opens the port + 10000 (its gRPC port) and refuses
    to start when that passes 65535, which the kernel's ephemeral ports often do."""
    for port in range(31000 + os.getpid() % 1000 * 20, 55000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below 55000")


# ---------------------------------------------------------------------------------------------------------
# one server


class Server:
    def __init__(self, name: str, model: dict, site: str, workdir: str, *, mode: str, graphs: bool, logdir: str):
        self.name, self.mode, self.graphs = name, mode, graphs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(logdir, f"server_{name.replace(', ', '_')}.log")
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model["target"],
                "--tp", "2", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(self.port),
                "--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--enforce-disable-flashinfer-allreduce-fusion", "--disable-custom-all-reduce",
                "--disable-piecewise-cuda-graph", "--mem-fraction-static", "0.3", "--max-total-tokens", "8192",
                "--max-running-requests", "4", "--random-seed", "0", "--log-level", "info",
                "--grammar-backend", "none",
                "--speculative-draft-model-path", model["draft"], *EAGLE,
                "--sm120-allreduce", mode, "--sm120-allreduce-tune", "off"]
        args += ["--cuda-graph-bs", *GRAPH_BS] if graphs else ["--disable-cuda-graph"]
        env = server_env(site)
        env["SGLANG_SM120_CACHE"] = os.path.join(workdir, f"cache_{name.replace(', ', '_')}")
        self.env = env
        self.args = args
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
                                     start_new_session=True)

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def wait_ready(self) -> float:
        t0 = time.time()
        while time.time() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode} while starting:\n"
                                     f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - t0
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
    out = server.post("/generate", {
        "text": prompt, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    meta = out["meta_info"]
    return {"text": out["text"],
            "output_ids": [t[1] for t in meta["output_token_logprobs"]],
            "input_logprobs": [t[0] for t in meta["input_token_logprobs"]],
            "output_logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "spec_verify_ct": meta.get("spec_verify_ct"), "spec_accepted_drafts": meta.get("spec_accepted_drafts"),
            "completion_tokens": meta.get("completion_tokens")}


def run_server(name: str, model: dict, site: str, workdir: str, *, mode: str, graphs: bool, logdir: str) -> dict:
    server = Server(name, model, site, workdir, mode=mode, graphs=graphs, logdir=logdir)
    record: dict = {"name": name, "mode": mode, "graphs": graphs, "log": server.log_path}
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
        if graphs:
            record["bench_one_batch_server"] = bench_one_batch(server, model, workdir)
    finally:
        server.stop()
        text = server.text()
        record["enabled_lines"] = [ln for ln in text.splitlines() if "sm120 IPC all-reduce ENABLED" in ln]
        record["disabled_lines"] = [ln for ln in text.splitlines() if "sm120 IPC all-reduce DISABLED" in ln]
        record["patch_lines"] = sorted({re.sub(r"pid \d+", "pid N", ln) for ln in text.splitlines()
                                        if "[sm120 server-test patch" in ln})
        record["graph_capture_lines"] = [ln for ln in text.splitlines() if re.search(r"[Cc]apture cuda graph end", ln)]
        record["capture_guard_lines"] = [ln for ln in text.splitlines() if "feed aux hidden-state captures" in ln]
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
    out_dir = os.environ.get("SGL_SM120_SERVER_TEST_OUT", workdir)
    os.makedirs(out_dir, exist_ok=True)
    site = write_site(os.path.join(workdir, "site"))
    t0 = time.time()
    made = subprocess.run([sys.executable, "-m", "tests.gpu.kimi_shaped_model", os.path.join(workdir, "model"),
                           "--device", "cuda"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    model = json.loads(made.stdout.strip().splitlines()[-1])
    report: dict = {"sglang": importlib.metadata.version("sglang"), "model": model,
                    "model_write_s": round(time.time() - t0, 1), "runs": {}, "checks": {}}
    runs = report["runs"]

    def save():
        with open(os.path.join(out_dir, "server_test.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    failures = []

    def check(name: str, ok: bool, detail) -> None:
        report["checks"][name] = {"ok": bool(ok), "detail": detail}
        if not ok:
            failures.append(f"{name}: {detail}")

    try:
        for name, mode, graphs in (("off, eager", "off", False), ("on, eager", "on", False),
                                   ("on, graphs", "on", True)):
            try:
                runs[name] = run_server(name, model, site, workdir, mode=mode, graphs=graphs, logdir=out_dir)
            except AssertionError as e:
                runs[name] = {"error": str(e)[-6000:]}
                check(f"{name}: started and answered", False, str(e)[-3000:])
            save()
        _judge(runs, check)
    finally:
        save()
    assert not failures, "\n".join(failures)


def _judge(runs: dict, check) -> None:
    off, eager, graphs = runs.get("off, eager"), runs.get("on, eager"), runs.get("on, graphs")
    for name, run in runs.items():
        if "error" in run:
            continue
        on = run["mode"] == "on"
        check(f"{name}: ENABLED line on rank 0" if on else f"{name}: no ENABLED line",
              bool(run["enabled_lines"]) == on, run["enabled_lines"] or run["disabled_lines"])
        states = run["info_after"]
        check(f"{name}: /get_server_info reports the backend {'active' if on else 'inactive'}",
              bool(states) and all(bool(s.get("active")) == on for s in states), states)
        check(f"{name}: EAGLE-3 verified drafts", all((r["spec_verify_ct"] or 0) > 0 for r in run["requests"]),
              [r["spec_verify_ct"] for r in run["requests"]])
        if on:
            guard = [ln for ln in run["capture_guard_lines"] if "layers [1, 2, 3]" in ln]
            check(f"{name}: the layers feeding EAGLE-3's captures (1, 2, 3) keep their MLP all-reduce, on both ranks",
                  {"TP0", "TP1"} <= {t for ln in guard for t in ("TP0", "TP1") if t in ln}, run["capture_guard_lines"])
            stats = [s.get("stats") or {} for s in states]
            if not run["graphs"]:
                check(f"{name}: fused all-reduce + RMSNorm served the layer boundaries",
                      all(s.get("sm120_fused", 0) > 0 and s.get("sm120", 0) > 0 for s in stats), stats)
            calls = run["device_calls"]
            check(f"{name}: the kernels' device call counter grows across requests",
                  all(b > a for a, b in zip(calls[:-1], calls[1:], strict=True)), calls)
    if graphs and "error" not in graphs:
        check("on, graphs: CUDA graphs captured", bool(graphs["graph_capture_lines"]), graphs["graph_capture_lines"])
        check("on, graphs: the captured logits all-gather went through our kernel",
              any("captured all-gather" in ln for ln in graphs["patch_lines"]), graphs["patch_lines"])
        bench = graphs.get("bench_one_batch_server") or {}
        check("on, graphs: sglang.bench_one_batch_server ran", bench.get("returncode") == 0,
              {k: bench.get(k) for k in ("returncode", "stderr_tail")})
    if off and eager and "error" not in off and "error" not in eager:
        diffs = sorted(abs(a - b) for r_off, r_on in zip(off["requests"], eager["requests"], strict=True)
                       for a, b in zip(r_off["input_logprobs"][1:], r_on["input_logprobs"][1:], strict=True))
        median = diffs[len(diffs) // 2]
        outliers = sum(d > LOGPROB_OUTLIER_NATS for d in diffs)
        check(f"on against off: teacher-forced input logprobs, median |diff| <= {LOGPROB_MEDIAN_TOL} and at most "
              f"{LOGPROB_OUTLIER_SHARE:.0%} of positions beyond {LOGPROB_OUTLIER_NATS} nats",
              median <= LOGPROB_MEDIAN_TOL and outliers <= LOGPROB_OUTLIER_SHARE * len(diffs),
              {"positions": len(diffs), "median": median, "max": diffs[-1], "beyond": outliers})
        # Greedy decoding follows an argmax: past the first token a near tie may go either way on rounding and
        # the texts part (README says so too); the first token of each prompt must agree, and how long each
        # pair agrees is recorded.
        pairs = list(zip(off["requests"], eager["requests"], strict=True))
        agree = [next((i for i, (a, b) in enumerate(zip(r_off["output_ids"], r_on["output_ids"], strict=True))
                       if a != b), len(r_off["output_ids"])) for r_off, r_on in pairs]
        check("on against off: the first greedy token of every prompt equal", all(n >= 1 for n in agree),
              {"tokens_agreeing_per_prompt": agree, "of": NEW_TOKENS})
    if eager and graphs and "error" not in eager and "error" not in graphs:
        pairs = list(zip(eager["requests"], graphs["requests"], strict=True))
        check("on, eager against on, graphs: identical greedy outputs",
              all(r_e["output_ids"] == r_g["output_ids"] for r_e, r_g in pairs),
              [(r_e["output_ids"], r_g["output_ids"]) for r_e, r_g in pairs])
