"""Is NCCL itself slow here? `python -m sglang_sm120.nccl_check` times NCCL's all-reduce at the verify sizes
([rows, hidden] bf16) and the logits all-gather in a CUDA graph, with the environment as it is and with each P2P
change that matters, every variant in fresh processes (one per GPU: NCCL reads its variables once), and says what to
set. It exits 1 when NCCL could not be timed as the environment is (fewer than two GPUs, or NCCL failed).

The variants and the advice: core/nccl.py. torch is imported inside functions."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

from sgl_kernel_sm120 import settings as kernel_settings
from sgl_kernel_sm120.settings import count, seconds

from .core import config
from .core import nccl as core

ROWS = (1, 4, 16, 64)  # the verify sizes
LOGIT_ROWS = 4  # the all-gather: [4, vocab / world] per rank
REPLAYS, WARMUP = 50, 3
GRACE_S = 10.0  # after one rank failed, how long the others get to end by themselves


def labels(hidden: int, vocab: int, world: int) -> tuple[list[str], str]:
    return [f"{r}x{hidden}" for r in ROWS], f"all-gather {LOGIT_ROWS}x{vocab // world}"


def run(world: int | None = None, hidden: int = 7168, vocab: int = 163840, timeout_s: float = 300.0, *,
        devices: int | None = None, environ: dict | None = None, rank_command: list[str] | None = None) -> dict:
    """The check's result (JSON-able); on fewer than two GPUs only 'skipped', and no process is started.
    devices, rank_command: stand-ins for the tests (a GPU count; the command line of a rank before its options)."""
    env = dict(os.environ if environ is None else environ)
    if devices is None:
        import torch

        devices = torch.cuda.device_count()
    world = devices if world is None else world
    out = {"world": world, "hidden": hidden, "vocab": vocab, "gpus": devices, "settings": core.settings(env),
           "replays": REPLAYS, "variants": [], "skipped": None}
    if not 2 <= world <= devices:
        why = (f"needs two GPUs, this machine has {devices}" if devices < 2 else
               f"runs 2 to {devices} ranks (one per GPU), not {world}")
        return {**out, "skipped": f"NCCL check: {why} (nothing was run)"}
    plan = [core.BASE, *core.variant_plan(env)]
    deadline = time.monotonic() + timeout_s
    for i, variant in enumerate(plan):
        share = (deadline - time.monotonic()) / (len(plan) - i)  # a hung variant leaves the others their time
        out["variants"].append(_run_variant(variant, env, world, hidden, vocab, share, rank_command))
    out["p2p_works"] = next((v["p2p_works"] for v in out["variants"] if v["p2p_works"] is not None), None)
    ar, _ = labels(hidden, vocab, world)  # the all-gather is timed to be shown, not advised on
    ok = [v for v in out["variants"] if not v["error"]]
    advice = core.advice({v["variant"]: {s: v["times_us"][s] for s in ar} for v in ok},
                         {v["variant"]: v["transports"] for v in ok}, out["p2p_works"])
    return {**out, "advice": [a.line for a in advice]}


def report_lines(result: dict) -> list[str]:
    if result["skipped"]:
        return [result["skipped"]]
    ar, ag = labels(result["hidden"], result["vocab"], result["world"])
    versions = sorted({str(v["nccl_version"]) for v in result["variants"] if v["nccl_version"]})
    lines = [f"NCCL {' / '.join(versions) or '(version not logged)'}, {result['world']} ranks, bf16, us per call "
             f"(CUDA graph; per replay the slowest rank; median of {result['replays']} replays):",
             f"  {'variant':<44}" + "".join(f"{s:>10}" for s in ar) + f"  {ag}"]
    for v in result["variants"]:
        t = v["times_us"]
        cells = f"  {v['error']}" if v["error"] else "".join(f"{t[s]:10.1f}" for s in ar) + f"  {t[ag]:.1f}"
        lines.append(f"  {v['variant']:<44}{cells}")
    for v in result["variants"]:
        said = "; ".join(f"{k} {' '.join(p)}" for k, p in core.pairs_by_kind(v["transports"]).items())
        lines.append(f"  transports, {v['variant']}: {said or 'no channel lines logged'}")
    if result["variants"][0]["error"]:
        return [*lines, "NCCL: nothing can be advised, NCCL did not run with the environment as it is"]
    return lines + (result.get("advice") or [f"NCCL: no change advised (none was {core.SPEEDUP}x faster at every "
                                             "verify size, and no pair goes through host memory while P2P works)"])


def _run_variant(variant, env, world, hidden, vocab, timeout_s, rank_command) -> dict:
    rec = {"variant": variant, "changes": core.changes(variant), "times_us": {}, "transports": {},
           "nccl_version": None, "p2p_works": None, "error": None}
    if timeout_s <= 0:
        return {**rec, "error": "not run: the check's time was spent"}
    # the ranks import the packages this process runs: the folders holding sglang_sm120 and sgl_kernel_sm120
    here = os.pathsep.join(dict.fromkeys(os.path.dirname(os.path.dirname(os.path.abspath(path)))
                                         for path in (__file__, kernel_settings.__file__)))
    env = {**core.apply(variant, env), "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": core.LOG_SUBSYS,
           "PYTHONPATH": os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])}
    with socket.socket() as sock:  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [*(rank_command or [sys.executable, "-m", "sglang_sm120.nccl_check"]), "--world", str(world),
           "--port", str(port), "--hidden", str(hidden), "--vocab", str(vocab)]
    with tempfile.TemporaryDirectory(prefix="sm120-nccl-") as tmp:
        procs = []
        for r in range(world):
            with open(os.path.join(tmp, f"out.{r}.txt"), "w") as log:
                procs.append(subprocess.Popen([*cmd, "--rank", str(r), "--out", tmp], stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True,  # killed as a group
                                              env={**env, "NCCL_DEBUG_FILE": os.path.join(tmp, f"nccl.{r}.log")}))
        why = wait_all(procs, timeout_s)
        logs = core.parse_log("".join(_read(os.path.join(tmp, f"nccl.{r}.log")) for r in range(world)))
        rec.update(transports=logs["pairs"], nccl_version=logs["nccl_version"])
        ranks = [_read(os.path.join(tmp, f"rank{r}.json")) for r in range(world)]
        if all(ranks):  # every rank wrote its times before NCCL's teardown: one that hung or failed loses none
            ranks = [json.loads(x) for x in ranks]
            wrong = [s for s in ranks[0]["times"] if any(s in x["wrong"] for x in ranks)]
            if wrong:
                return {**rec, "error": f"NCCL's results were wrong ({', '.join(wrong)}): not a setting to use"}
            from .tuning.timing import aggregate_iteration_times  # per replay the slowest rank, then the median

            rec["times_us"] = {s: aggregate_iteration_times([x["times"][s] for x in ranks])["median_us"]
                               for s in ranks[0]["times"]}
            return {**rec, "p2p_works": ranks[0]["p2p_works"]}
        own = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (0, -signal.SIGKILL if why else 0)]
        for r, code in own[:1]:  # the first rank that failed by itself: its code and last line
            tail = _read(os.path.join(tmp, f"out.{r}.txt")).strip().splitlines()[-1:]
            why += ("; " if why else "") + f"rank {r} exited with code {code}" + "".join(f" ({t[-200:]})" for t in tail)
    return {**rec, "error": why or "a rank ended without its times"}


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> str:
    """Wait for every process; kill them all (their process groups) past timeout_s, or GRACE_S after one failed
    while others still run. Returns why they were killed, or ''."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        late = now > deadline
        if late or (failed_at is not None and now - failed_at > GRACE_S):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):  # it may have ended since
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return (f"NCCL did not finish within {timeout_s:.0f} s" if late else
                    f"a rank failed and the others had not ended {GRACE_S:g} s later") + ": its processes were killed"
        time.sleep(0.05)
    return ""


def _read(path: str) -> str:
    return pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def _rank_main(a) -> int:
    """One rank: NCCL's all-reduce at each verify size, then the all-gather, each a CUDA graph of K calls replayed
    REPLAYS times (per call = replay / K, as the tuner times); the parent takes the slowest rank per replay."""
    import torch
    import torch.distributed as dist

    from .tuning import timing

    torch.cuda.set_device(a.rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            device_id=torch.device("cuda", a.rank))

    def timed(step, nbytes: int) -> list[float]:
        calls = timing.calls_per_replay(nbytes)
        graph, _ = timing.capture_graph(step, calls)  # one eager round first: NCCL connects its channels there
        return [t / calls for t in timing.replay_times(graph, REPLAYS, warmup=WARMUP)]

    ar, ag = labels(a.hidden, a.vocab, a.world)
    times, wrong = {}, []  # each size checked once after timing: a faster setting that sums wrong is no fix
    for rows, label in zip(ROWS, ar, strict=True):
        x = torch.zeros(rows, a.hidden, dtype=torch.bfloat16, device="cuda")  # zeros: the sum stays finite
        times[label] = timed(lambda k, x=x: dist.all_reduce(x), x.nbytes)
        dist.all_reduce(x.fill_(a.rank + 1))
        wrong += [] if bool((x == a.world * (a.world + 1) // 2).all()) else [label]  # small integers: exact in bf16
    shard = torch.zeros(LOGIT_ROWS, a.vocab // a.world, dtype=torch.bfloat16, device="cuda")
    full = torch.empty(LOGIT_ROWS * a.world, a.vocab // a.world, dtype=torch.bfloat16, device="cuda")
    times[ag] = timed(lambda k: dist.all_gather_into_tensor(full, shard), full.nbytes)
    dist.all_gather_into_tensor(full, shard.fill_(a.rank))
    want = torch.arange(a.world, device="cuda").repeat_interleave(LOGIT_ROWS)[:, None]  # rank r's rows hold r
    wrong += [] if bool((full == want).all()) else [ag]
    peers = [(i, j) for i in range(a.world) for j in range(a.world) if i != j]
    p2p = all(torch.cuda.can_device_access_peer(i, j) for i, j in peers) if a.rank == 0 else None
    write_times(a, times, p2p, wrong)
    dist.destroy_process_group()
    return 0


def write_times(a, times: dict, p2p_works: bool | None, wrong: list[str]) -> None:
    """A rank's result file (rank<r>.json in --out) for the parent; wrong: the sizes where NCCL's result was."""
    with open(os.path.join(a.out, f"rank{a.rank}.tmp"), "w") as f:
        json.dump({"times": times, "p2p_works": p2p_works, "wrong": wrong}, f)
    os.replace(f.name, os.path.join(a.out, f"rank{a.rank}.json"))  # whole or absent, even if killed meanwhile


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sglang_sm120.nccl_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU)")
    for flag, parse, default, text in (("--hidden", count(1), 7168, "the model's hidden size"),
                                       ("--vocab", count(1), 163840, "the model's vocabulary (the logits all-gather)"),
                                       ("--timeout", seconds(), 300.0, "seconds for the whole check")):
        ap.add_argument(flag, action=config.SettingAction, parse=parse, default=default, help=text)
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead")
    for name in ("--rank", "--port"):  # a rank process (started by run())
        ap.add_argument(name, type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.rank is not None:
        return _rank_main(a)
    result = run(a.world, a.hidden, a.vocab, a.timeout)
    print(json.dumps(result, indent=1) if a.json else "\n".join(report_lines(result)))
    return 1 if result["skipped"] or result["variants"][0]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
