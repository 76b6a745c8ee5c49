"""The parent side of a tune: one process per rank (tuning/child.py), watched, all within one deadline. A fault (or
our kernels' trap) ends the CUDA context of the process that ran it, so candidates run in children: a child that
dies, or a group that makes no progress for `stall_s`, is blamed on the candidate last begun, which
`tune_with_retries` excludes from its size up before it starts the group again (the caller records the blame as
each attempt ends). A tune cut by its deadline blames nobody, and a child's own Python error is no candidate's
fault: neither is retried. Children die with this process however it ends (tuning/child.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from .child import MARKER
from .tuner import TuneSpec

CHILD_MODULE = "sglang_sm120.tuning.child"
EXIT_GRACE_S = 15.0  # after one child ended badly, how long the others get to end by themselves
DEADLINE = "the tune did not finish within"


def child_env(base: dict | None = None) -> dict:
    """Ours, with both packages' parent folders first on PYTHONPATH (we may have found them through sys.path)."""
    import sgl_kernel_sm120

    env = dict(os.environ if base is None else base)
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../sglang_sm120/tuning
    parents = [ours, os.path.dirname(os.path.dirname(os.path.abspath(sgl_kernel_sm120.__file__)))]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(parents + rest)), "PYTHONUNBUFFERED": "1"}


@dataclasses.dataclass
class ChildOutcome:
    rank: int
    returncode: int | None = None
    table: dict | None = None
    digest: str | None = None
    error: str | None = None  # the child's own error event
    last_begin: dict | None = None
    begins: int = 0
    killed: str = ""  # why the parent killed it ("" when it ended by itself)
    tail: list[str] = dataclasses.field(default_factory=list)  # its last lines of output
    key: dict | None = None  # the table key the child measures under (its setup event)
    retry: bool = False  # its error asks for a new attempt (its cluster check broke its CUDA context)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # event -> seconds since the spawn

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.table is not None and not self.killed


@dataclasses.dataclass
class Attempt:
    table: dict | None
    digest: str | None
    error: str | None
    culprit: dict | None  # {dtype, kind, candidate, from_bytes, reason} when a candidate is to blame
    outcomes: list[ChildOutcome]
    retry: bool = False  # no candidate to blame, but a new attempt may succeed


def summarize(outcomes: Sequence[ChildOutcome]) -> Attempt:
    """One outcome of a group's children (pure)."""
    outcomes = list(outcomes)
    if outcomes and all(o.ok for o in outcomes):
        if len({o.digest for o in outcomes}) == 1:
            return Attempt(outcomes[0].table, outcomes[0].digest, None, None, outcomes)
        return Attempt(None, None, "the ranks reported different tables", None, outcomes)
    if any(o.error for o in outcomes):
        errors = [o for o in outcomes if o.error]
        return Attempt(None, None, "; ".join(f"rank {o.rank}: {o.error}" for o in errors), None, outcomes,
                       retry=all(o.retry for o in errors))
    first = min((o for o in outcomes if not o.ok), key=lambda o: (o.killed != "", o.rank))  # one that died first
    why = first.killed
    if first.killed.startswith(DEADLINE):  # the clock ran out, not a candidate: nobody is blamed
        return Attempt(None, None, why, None, outcomes)
    if not why:
        tail = " | ".join(line for line in first.tail[-3:] if line.strip())
        why = f"rank {first.rank} died (exit code {first.returncode})" + (f": {tail[-300:]}" if tail else "")
    begins = [o.last_begin for o in outcomes if o.last_begin]
    if not begins:
        return Attempt(None, None, why, None, outcomes)
    last = max(begins, key=lambda b: int(b.get("seq", 0)))  # the candidate any rank began last is to blame
    culprit = {"dtype": last["dtype"], "kind": last["kind"], "candidate": last["candidate"],
               "from_bytes": int(last["bytes"]), "reason": f"{why} while running it"}
    return Attempt(None, None, f"{why} while running {last['candidate']}", culprit, outcomes)


class _Child:
    def __init__(self, rank: int, command: list[str], env: dict, on_event: Callable[[int, dict], None]):
        self.outcome, self.on_event, self.last_event = ChildOutcome(rank), on_event, time.monotonic()
        self.spawned = self.last_event
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        # Its own session, so that killing it ends whatever it started too (by its process-group id).
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, name=f"sm120-tune-rank{rank}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            try:
                event = json.loads(line[len(MARKER):]) if line.startswith(MARKER) else None
            except ValueError:
                event = None
            if not isinstance(event, dict):  # not ours: kept for the report of a child that died
                self.tail.append(line)
                continue
            self.last_event = time.monotonic()
            kind = event.get("event")
            self.outcome.phases.setdefault(str(kind), round(self.last_event - self.spawned, 3))
            if kind == "setup" and isinstance(event.get("key"), dict):
                self.outcome.key = event["key"]
            elif kind == "begin":
                self.outcome.begins += 1
                self.outcome.last_begin = {**event, "seq": self.outcome.begins}
            elif kind == "done":
                self.outcome.table, self.outcome.digest = event.get("table"), event.get("digest")
            elif kind == "error":
                self.outcome.error, self.outcome.retry = str(event.get("error")), bool(event.get("retry"))
                self.tail.extend(str(event.get("trace", "")).splitlines()[-5:])
            self.on_event(self.outcome.rank, event)

    def kill(self, why: str) -> None:
        if self.proc.poll() is None:
            self.outcome.killed = why
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def finish(self) -> ChildOutcome:
        self.proc.wait()
        self.reader.join(timeout=5)
        self.outcome.returncode = self.proc.returncode
        self.outcome.tail = list(self.tail)
        return self.outcome


def run_children(ranks: Sequence[tuple[int, int]], world: int, spec: TuneSpec, *, deadline: float, stall_s: float,
                 on_event: Callable[[int, dict], None] | None = None, command: Callable[..., list[str]] | None = None,
                 env: dict | None = None) -> list[ChildOutcome]:
    """One child per (rank, device) of `ranks`, awaited until `deadline` (time.monotonic()); all are killed when
    none made progress for `stall_s`, or when one ended badly and the others did not follow within EXIT_GRACE_S.
    `command(rank, device, spec_path)` replaces the child's command line (tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = command or (lambda rank, device, spec_path: [
        sys.executable, "-m", CHILD_MODULE, "--rank", str(rank), "--world", str(world), "--device", str(device),
        "--port", str(port), "--spec", spec_path, "--parent-pid", str(os.getpid())])
    env = child_env() if env is None else env
    on_event = on_event or (lambda rank, event: None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="sm120-tune-spec-", delete=False) as handle:
        json.dump(dataclasses.asdict(spec), handle)
        spec_path = handle.name
    children: list[_Child] = []
    budget = max(0.0, deadline - time.monotonic())
    try:
        for rank, device in ranks:
            children.append(_Child(rank, command(rank, device, spec_path), env, on_event))
        bad_since = None
        while any(c.proc.poll() is None for c in children):
            time.sleep(0.05)
            now = time.monotonic()
            alive = [c for c in children if c.proc.poll() is None]
            ended_badly = [c for c in children if c.proc.poll() not in (None, 0)]
            if ended_badly and bad_since is None:
                bad_since = now
            if now > deadline:
                for c in alive:
                    c.kill(f"{DEADLINE} {budget:.0f} s")
            elif alive and now - max(c.last_event for c in children) > stall_s:
                for c in alive:
                    c.kill(f"no progress for {stall_s:.0f} s")
            elif bad_since is not None and now - bad_since > EXIT_GRACE_S:
                for c in alive:
                    c.kill(f"another rank ended ({ended_badly[0].outcome.rank}: exit code "
                           f"{ended_badly[0].proc.returncode}) and this one did not")
        return [c.finish() for c in children]
    finally:
        for c in children:
            c.kill("the parent is stopping")
            with contextlib.suppress(Exception):
                c.proc.wait(timeout=5)
        os.unlink(spec_path)


def tune_with_retries(world: int, devices: Sequence[int], spec: TuneSpec, *, retries: int, deadline: float,
                      stall_s: float, on_event=None, on_attempt: Callable[[Attempt], None] | None = None,
                      command=None, env=None) -> Attempt:
    """All ranks' children until `deadline`, again (at most `retries` times) after a candidate killed one, with that
    candidate excluded from its size up, or after an error that asks for it: the last attempt's outcome.
    `on_attempt(attempt)` sees every attempt as it ends (the caller records its blame at once)."""
    ranks, attempt = list(zip(range(world), devices, strict=True)), None
    for _ in range(retries + 1):
        attempt = summarize(run_children(ranks, world, spec, deadline=deadline, stall_s=stall_s, on_event=on_event,
                                         command=command, env=env))
        if on_attempt is not None:
            on_attempt(attempt)
        if attempt.table is not None or (attempt.culprit is None and not attempt.retry):
            return attempt
        if time.monotonic() >= deadline:
            attempt.error = f"{attempt.error}; no time left for another attempt"
            return attempt
        if attempt.culprit is not None:
            if any(dict(rule, reason=None) == dict(attempt.culprit, reason=None) for rule in spec.exclude):
                attempt.error = f"{attempt.error} (again, though excluded: giving up)"
                return attempt
            spec.exclude.append(attempt.culprit)
    assert attempt is not None
    attempt.error = f"{attempt.error}; gave up after {retries + 1} attempts"
    return attempt


def planned(devices: Sequence[int], hostmem: str) -> tuple[str, dict]:
    """(digests, `part=digest` by part, and a key naming the GPUs) of what a group on these CUDA devices would be
    keyed by, computed here before any rank process starts: every rank's key facts, P2P, the planned workspace
    (core/plan.py), the launch switches and the GPUs' cached cluster-check verdicts. A table records the digests it
    was tuned under, so a launch knows without starting a GPU process whether it has one. Raises
    core.plan.PlanRefused when no workspace of ours can be built."""
    import torch

    from sgl_kernel_sm120 import _ext, cluster_check
    from sgl_kernel_sm120.settings import launch_switches, read

    from ..core import plan
    from ..core.facts import key_facts
    from ..core.topology import probe
    from ..routing.table import digest

    facts = [key_facts(torch.device("cuda", d)) for d in devices]
    p2p = [[a == b or bool(torch.cuda.can_device_access_peer(a, b)) for b in devices] for a in devices]
    uuids = [f["uuid"] for f in facts]
    topology = probe(uuids) if all(all(row) for row in p2p) else None
    first = plan.plan(p2p, hostmem, topology)
    settings, library = read(), _ext.library_path()
    # The verdicts under the name a tune rank caches them by (torch's UUID, which has no "GPU-" prefix).
    verdicts = [dataclasses.astuple(cluster_check.cached_verdict(str(torch.cuda.get_device_properties(d).uuid),
                                                                 library, settings))[:2] for d in devices]
    seen = {"facts": [{k: v for k, v in f.items() if k != "nccl_settings"} for f in facts],
            "nccl": [f["nccl_settings"] for f in facts], "p2p": p2p, "plan": dataclasses.asdict(first),
            "switches": launch_switches(settings), "pdl": settings.pdl, "verdicts": verdicts}
    # One digest per part, so that a launch that finds a table tuned under other facts can say which ones differ.
    return " ".join(f"{part}={digest(value)[:12]}" for part, value in seen.items()), \
        {"world_size": len(devices), "gpus": [{"uuid": u} for u in uuids]}
