"""Is NCCL itself slow here? NCCL's all-reduce at the verify sizes ([rows, hidden] bf16) and the logits all-gather,
timed in a CUDA graph with the environment as it is and with each P2P change that matters (core/nccl.py), every
variant in fresh processes (one per GPU: NCCL reads its variables once), then what to set.
`python -m sglang_sm120.nccl_check [--world N]` prints the report; torch is imported only by the rank processes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .core import nccl as core

ROWS = (1, 4, 16, 64)  # the verify sizes
LOGIT_ROWS = 4  # the all-gather: [4, vocab / world] per rank
REPLAYS, WARMUP = 50, 3
GRACE_S = 10.0  # after one rank failed, how long the others get to end by themselves
SUBSYS = "INIT,P2P,SHM,NET"  # channel lines are INIT|P2P, INIT|SHM, INIT|NET in 2.18-2.30; the version line is ALL


def labels(hidden: int, vocab: int, world: int) -> tuple[list[str], str]:
    return [f"{r}x{hidden}" for r in ROWS], f"all-gather {LOGIT_ROWS}x{vocab // world}"


def slowest_rank_median(per_rank: list[list[float]]) -> float:
    """per_rank[r][i]: rank r's us in replay i -> the median over replays of the slowest rank of each replay."""
    from .tuning.timing import aggregate_iteration_times

    return aggregate_iteration_times(per_rank)["median_us"]


def run(world: int | None = None, hidden: int = 7168, vocab: int = 163840, timeout_s: float = 300.0, *,
        devices: int | None = None, environ: dict | None = None, fake: str | None = None) -> dict:
    """The check's result (JSON-able); on fewer than two GPUs only 'skipped', and no process is started.
    devices/fake: stand-ins for the tests (a GPU count; rank processes that print canned lines)."""
    env = dict(os.environ if environ is None else environ)
    n = _gpu_count() if devices is None else devices
    world = n if world is None else world
    out = {"world": world, "hidden": hidden, "vocab": vocab, "gpus": n, "settings": core.settings(env),
           "replays": REPLAYS, "variants": [], "skipped": None}
    if n < 2 or world < 2:
        return {**out, "skipped": f"NCCL check: needs two GPUs, this machine has {n} (nothing was run)"}
    if world > n:
        return {**out, "skipped": f"NCCL check: {world} ranks asked for, this machine has {n} GPUs (nothing was run)"}
    plan = [core.BASE, *core.variant_plan(env)]
    deadline = time.monotonic() + timeout_s
    for i, variant in enumerate(plan):
        share = (deadline - time.monotonic()) / (len(plan) - i)  # a hung variant leaves the others their time
        out["variants"].append(_run_variant(variant, env, world, hidden, vocab, share, fake))
    out["p2p_works"] = next((v["p2p_works"] for v in out["variants"] if v["p2p_works"] is not None), None)
    out["advice"] = [a.line for a in advise(out)]
    return out


def advise(result: dict) -> list[core.Advice]:
    ar, _ = labels(result["hidden"], result["vocab"], result["world"])
    ok = [v for v in result["variants"] if not v["error"]]
    times = {v["variant"]: {s: v["times_us"][s] for s in ar} for v in ok}
    return core.advice(times, {v["variant"]: v["transports"] for v in ok}, result.get("p2p_works"))


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
        seen = core.pairs_by_kind(v["transports"])
        said = "; ".join(f"{k} {' '.join(p)}" for k, p in seen.items()) or "no channel lines logged"
        lines.append(f"  transports, {v['variant']}: {said}")
    if result["variants"][0]["error"]:
        return [*lines, "NCCL: nothing can be advised, NCCL did not run with the environment as it is"]
    return lines + (result.get("advice") or [f"NCCL: no change advised (none was {core.SPEEDUP}x faster at every "
                                             "verify size, and no pair goes through host memory while P2P works)"])


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_variant(variant, env, world, hidden, vocab, timeout_s, fake) -> dict:
    rec = {"variant": variant, "changes": core.changes(variant), "times_us": {}, "transports": {},
           "nccl_version": None, "p2p_works": None, "error": None}
    if timeout_s <= 0:
        return {**rec, "error": "not run: the check's time was spent"}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding sglang_sm120
    env = {**core.apply(variant, env), "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": SUBSYS,
           "PYTHONPATH": os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="sm120-nccl-") as tmp:
        cmd = [sys.executable, "-m", "sglang_sm120.nccl_check", "--world", str(world), "--port", str(_free_port()),
               "--hidden", str(hidden), "--vocab", str(vocab), "--out", tmp, *(["--fake", fake] if fake else [])]
        procs = []
        for r in range(world):
            with open(os.path.join(tmp, f"out.{r}.txt"), "w") as log:
                procs.append(subprocess.Popen([*cmd, "--rank", str(r)], stdout=log, stderr=subprocess.STDOUT,
                                              env={**env, "NCCL_DEBUG_FILE": os.path.join(tmp, f"nccl.{r}.log")},
                                              start_new_session=True))  # its own group: a kill ends its children
        why = wait_all(procs, timeout_s)
        failed = sorted((p.returncode < 0, r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0)
        if failed and failed[0][2] > 0:  # a rank that failed by itself (not one we killed): say which, and why
            tail = _read(os.path.join(tmp, f"out.{failed[0][1]}.txt")).strip().splitlines()[-1:]
            said = f"rank {failed[0][1]} exited with code {failed[0][2]}" + (f" ({tail[0][-200:]})" if tail else "")
            why = f"{why}; {said}" if why else said
        logs = core.merge_logs(core.parse_log(_read(os.path.join(tmp, f"nccl.{r}.log"))) for r in range(world))
        rec.update(transports=logs["pairs"], nccl_version=logs["nccl_version"], error=why or None)
        if why:
            return rec
        ranks = [json.loads(_read(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    rec["times_us"] = {s: slowest_rank_median([x["times"][s] for x in ranks]) for s in ranks[0]["times"]}
    rec["p2p_works"] = ranks[0].get("p2p_works")
    return rec


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
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        p.kill()
            for p in procs:
                p.wait()
            return (f"NCCL did not finish within {timeout_s:.0f} s" if late else
                    f"a rank failed and the others had not ended {GRACE_S:g} s later") + ": its processes were killed"
        time.sleep(0.05)
    return ""


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _rank_main(a) -> int:
    """One rank: NCCL's all-reduce at each verify size, then the all-gather, each timed as a CUDA graph of K calls
    replayed REPLAYS times (per call = replay / K); the parent takes the slowest rank per replay."""
    import torch
    import torch.distributed as dist

    from .tuning import timing

    torch.cuda.set_device(a.rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            device_id=torch.device("cuda", a.rank))
    ar, ag = labels(a.hidden, a.vocab, a.world)
    times = {}
    for rows, label in zip(ROWS, ar, strict=True):
        x = torch.zeros(rows, a.hidden, dtype=torch.bfloat16, device="cuda")  # zeros: the sum stays finite
        times[label] = _graph_times(lambda k, x=x: dist.all_reduce(x), x.nbytes, timing)
    shard = torch.zeros(LOGIT_ROWS, a.vocab // a.world, dtype=torch.bfloat16, device="cuda")
    full = torch.empty(LOGIT_ROWS * a.world, a.vocab // a.world, dtype=torch.bfloat16, device="cuda")
    times[ag] = _graph_times(lambda k: dist.all_gather_into_tensor(full, shard), full.nbytes, timing)
    peers = [(i, j) for i in range(a.world) for j in range(a.world) if i != j]
    p2p = all(torch.cuda.can_device_access_peer(i, j) for i, j in peers) if a.rank == 0 else None
    dist.destroy_process_group()
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump({"times": times, "p2p_works": p2p}, f)
    return 0


def _graph_times(step, nbytes: int, timing) -> list[float]:
    calls = timing.calls_per_replay(nbytes)
    graph, _ = timing.capture_graph(step, calls)
    return [t / calls for t in timing.replay_times(graph, REPLAYS, warmup=WARMUP)]


def _fake_rank(a) -> int:
    """Tests only: a rank that logs NCCL 2.28's lines and stand-in times (P2P with NCCL_P2P_LEVEL=SYS, else SHM)."""
    if a.fake == "hang" or (a.fake == "crash" and a.rank != 1):  # the others of a crashed rank hang, as in NCCL
        time.sleep(3600)
    if a.fake == "crash":
        print("stand-in rank failing")
        return 3
    p2p = core.p2p_level_is_sys(os.environ) and not core.p2p_disabled(os.environ)
    peer, via = (a.rank + 1) % a.world, "P2P/CUMEM/read" if p2p else "SHM/direct/direct"
    with open(os.environ["NCCL_DEBUG_FILE"], "w") as f:
        f.write(f"fake:{os.getpid()}:1 [{a.rank}] NCCL INFO NCCL version 2.28.9+cuda13.0\n")
        for c in range(2):
            f.write(f"fake:{os.getpid()}:1 [{a.rank}] NCCL INFO Channel {c:02d}{'/0' if p2p else ''} : "
                    f"{a.rank}[{a.rank}] -> {peer}[{peer}] via {via}\n")
    ar, ag = labels(a.hidden, a.vocab, a.world)
    base = 20.0 if p2p else 200.0
    times = {s: [base + a.rank + i % 3 for i in range(REPLAYS)] for s in [*ar, ag]}
    with open(os.path.join(a.out, f"rank{a.rank}.json"), "w") as f:
        json.dump({"times": times, "p2p_works": True if a.rank == 0 else None}, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_sm120.nccl_check", description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole check")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead")
    for name in ("--rank", "--port"):
        ap.add_argument(name, type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--fake", choices=("ok", "hang", "crash"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank is not None:
        return _fake_rank(a) if a.fake else _rank_main(a)
    result = run(a.world, a.hidden, a.vocab, a.timeout)
    print(json.dumps(result, indent=1) if a.json else "\n".join(report_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
