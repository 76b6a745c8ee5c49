"""The real-server test's own logic on CPU (tests/gpu/test_sglang_server.py and its test-side patches,
tests/gpu/server_patches.py): its command line parses with the installed SGLang's own parser, its instruments
(teacher forcing, the per-kind device counter, the negative controls' faults) do what they say, and its verdicts
pass a good synthetic run and fail broken ones."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from tests.gpu import server_patches as sp  # noqa: E402
from tests.gpu import test_sglang_server as st  # noqa: E402
from tests.gpu.kimi_shaped_model import SPECIAL, VOCAB, words  # noqa: E402

MODEL = {"target": "/m/target", "draft": "/m/draft", "layers": 9, "first_k_dense": 1, "eagle_layer_ids": [1, 3, 5]}
ROW = st.HIDDEN * 2
GAP_TOKENS = 5  # between the measured 4 and 8 rows, whose winners differ: NCCL's
COUNTS = {"0.5.23": {"fused": 17, "plain": 2}, "0.5.13.post1": {"fused": 14, "plain": 5}}
_table_path = ""


@pytest.fixture(autouse=True)
def table_file(tmp_path):
    """A table as the launcher's tune writes it: push won at 1-4 rows, pull at 8-16, so 5-7 rows are NCCL's."""
    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable

    push, pull = "sm120/ONESHOT/push/device/b132", "sm120/ONESHOT/pull/device/b132"
    rows = (1, 2, 3, 4, 8, 12, 16)
    points = [Point(r, r * ROW, {NCCL: 1e6, push: 10.0 if r <= 4 else 50.0, pull: 50.0 if r <= 4 else 10.0})
              for r in rows]
    table = RoutingTable.from_points(key={"world_size": 2}, measured="2026-12-04T10:00:00Z",
                                     workload={"hidden": st.HIDDEN}, measurements={("bfloat16", "plain"): points})
    global _table_path
    _table_path = cache.save(table, path=str(tmp_path / "routes.json"))


@pytest.mark.parametrize("graphs", [False, True])
def test_command_line_parses_with_this_release(graphs):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = st.launch_args(st.installed_release(), MODEL, port=30000, nccl_port=30007, mode="on", graphs=graphs)
    sm120 = args.index("--sm120-allreduce")  # the overlay's flags come with its plugin, not SGLang's parser
    parsed = parser.parse_args(args[3:sm120])
    tp = getattr(parsed, "tp_size", getattr(parsed, "tensor_parallel_size", None))  # renamed in 0.5.23
    assert parsed.model_path == "/m/target" and tp == 2 and parsed.trust_remote_code
    assert args[sm120:sm120 + 2 + len(st.TUNE_ARGS)] == ["--sm120-allreduce", "on", *st.TUNE_ARGS]
    if not graphs:  # both "on" runs have the graph run's largest batch, so one byte bound (parsed above)
        flag = "--cuda-graph-max-bs" if st.installed_release() == "0.5.13.post1" else "--cuda-graph-max-bs-decode"
        assert "--disable-cuda-graph" in args and args[args.index(flag) + 1] == st.GRAPH_BS[-1]


def _digest(x):
    return sp.capture_digest(x, 64)


def test_capture_digest_estimates_the_relative_error():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3 * 64, generator=gen)
    assert st.capture_error(_digest(x), _digest(x)) == 0.0
    small = st.capture_error(_digest(x + 0.001 * torch.randn(4, 192, generator=gen)), _digest(x))
    half = x.clone()
    half[0, 64:128] *= 0.5  # one capture read half a sum
    assert small < 0.01 and st.capture_error(_digest(half), _digest(x)) > 0.2
    assert sp.capture_digest(torch.randn(2, 100), 64) is None and len(_digest(x)) == 3


# ---------------------------------------------------------------------------------------------------------
# the instruments


def test_the_forced_successor_is_an_ordinary_word_for_ints_and_tensors_alike():
    tokens = torch.arange(VOCAB)
    forced = sp.forced_successor(tokens, VOCAB)
    assert int(forced.min()) >= len(SPECIAL) and int(forced.max()) < VOCAB
    assert [sp.forced_successor(t, VOCAB) for t in (0, 1, 4242, VOCAB - 1)] == forced[[0, 1, 4242, VOCAB - 1]].tolist()


def test_force_rows_takes_the_digest_first_then_makes_the_forced_token_the_argmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    logits[0, 7] = 9.0  # row 0 leads clearly at 7
    before = logits.clone()
    inputs = [11, 12, 13, 14]
    rows = sp.force_rows(logits, inputs, [0, 2])
    forced = [sp.forced_successor(t, 50) for t in inputs]
    assert logits.argmax(dim=-1).tolist() == forced
    logprobs = torch.log_softmax(before, dim=-1)
    for row, r in zip(rows, (0, 2), strict=True):
        assert row["lp"] == pytest.approx(float(logprobs[r, forced[r]]), abs=1e-6)
        assert row["top"] == int(before[r].argmax())
        second = float(logprobs[r].topk(2).values[1])
        assert row["lead"] == pytest.approx(row["top_lp"] - second, abs=1e-9) and row["lead"] >= 0
    assert rows[0]["top"] == 7 and rows[0]["lead"] > 5
    with pytest.raises(RuntimeError, match="teacher forcing"):
        sp.force_rows(torch.zeros(3, 50), inputs, [0])


def test_logits_rows_of_a_verify_and_of_a_prefill():
    verify = SimpleNamespace(input_ids=torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]), batch_size=2,
                             positions=torch.tensor([20, 21, 22, 23, 40, 41, 42, 43]))
    assert sp.logits_rows(verify, True) == ([5, 6, 7, 8, 9, 10, 11, 12], [0, 4], [20, 40])
    prefill = SimpleNamespace(input_ids=torch.tensor([5, 6, 7, 8, 9]), batch_size=2, extend_seq_lens_cpu=[3, 2],
                              positions=torch.tensor([0, 1, 2, 7, 8]))
    assert sp.logits_rows(prefill, False) == ([7, 9], [0, 1], [2, 8])
    prefill.extend_seq_lens_cpu, prefill.extend_seq_lens = None, torch.tensor([3, 2])
    assert sp.logits_rows(prefill, False) == ([7, 9], [0, 1], [2, 8])


def test_a_fault_word_arms_its_fault_and_nothing_else_does():
    vocabulary = words()
    for fault, word in sp.FAULT_WORDS.items():
        assert sp.fault_in([5, 6, vocabulary.index(word), 7]) == fault
        assert word in st.negative_prompt(fault).split()
    assert sp.fault_in([vocabulary.index(w) for p in st.PROMPTS for w in p.split()]) is None
    assert st.negative_controls("0.5.23") == ["shard_at_verify"]
    assert st.negative_controls("0.5.13.post1") == ["shard_at_verify", "capture_guard_off"]


def test_the_capture_guard_off_fault_lifts_the_keep_marks_only_meanwhile():
    from sglang_sm120.hooks.fusion import KEEP_MLP_ALLREDUCE

    layers = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(4))
    for i, layer in enumerate(layers):
        layer.layer_communicator = SimpleNamespace(**{KEEP_MLP_ALLREDUCE: i in (1, 3)})
    with sp.fault_applied("capture_guard_off", layers, verify=False) as lifted:
        assert lifted == 2 and not any(getattr(m.layer_communicator, KEEP_MLP_ALLREDUCE) for m in layers)
    assert [getattr(m.layer_communicator, KEEP_MLP_ALLREDUCE) for m in layers] == [False, True, False, True]
    with sp.fault_applied("shard_at_verify", layers, verify=False):
        assert sp._fault_now is None  # a prefill: the shard fault waits for the verify forwards
    with sp.fault_applied("shard_at_verify", layers, verify=True):
        assert sp._fault_now == "shard_at_verify"
    assert sp._fault_now is None


@pytest.fixture
def counted_backend(monkeypatch):
    """A TP backend on CPU with a fake workspace, its class wrapped as the server test wraps it (undone after)."""
    from sglang_sm120.core.config import OverlaySettings
    from sglang_sm120.runtime.backend import TPBackend
    from tests.support.fakes import FakeIpcAllReduce

    for name in ("build", "run", "run_fused"):
        monkeypatch.setattr(TPBackend, name, getattr(TPBackend, name))
    sp._count_calls_on_the_device()
    backend = TPBackend(name="tp:counted", ranks=[0, 1], rank_in_group=0, world_size=2, device=torch.device("cpu"),
                        settings=OverlaySettings(mode="on"), deterministic=False)
    backend.workspace = FakeIpcAllReduce(device=torch.device("cpu"), max_numel=1 << 16)
    setattr(backend, sp.KINDS_ATTR, torch.zeros(len(sp.KINDS), dtype=torch.int64))
    return backend


def test_the_device_counter_counts_each_call_by_kind(counted_backend):
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    counted_backend.run(x, "route")
    counted_backend.run_fused(x, x, torch.ones(64, dtype=torch.bfloat16), 1e-6, "route")
    sp._gathering = True
    try:
        counted_backend.run(x, "route")
    finally:
        sp._gathering = False
    assert dict(zip(sp.KINDS, getattr(counted_backend, sp.KINDS_ATTR).tolist(), strict=True)) == {
        "plain": 1, "fused": 1, "gather": 1}
    assert counted_backend.stats["sm120"] == 2 and counted_backend.stats["sm120_fused"] == 1


def test_the_shard_fault_sums_nothing_and_counts_as_a_fused_call(counted_backend):
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(4, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    weight = torch.ones(64, dtype=torch.bfloat16)
    summed = counted_backend.run_fused(x, residual, weight, 1e-6, "route")
    with sp.fault_applied("shard_at_verify", torch.nn.Linear(1, 1), verify=True):
        shard = counted_backend.run_fused(x, residual, weight, 1e-6, "route")
    assert counted_backend.workspace.calls == ["all_reduce_add_rmsnorm"]  # the fault's call reached no kernel
    assert torch.equal(shard[1], (x.float() + residual.float()).to(torch.bfloat16))
    assert not torch.equal(shard[1], summed[1])
    assert counted_backend.stats["sm120_fused"] == 2 and getattr(counted_backend, sp.KINDS_ATTR).tolist()[1] == 2


# ---------------------------------------------------------------------------------------------------------
# the verdicts, over synthetic runs


def _chain(prompt_ids, n=st.NEW_TOKENS):
    out, previous = [], prompt_ids[-1]
    for _ in range(n):
        previous = sp.forced_successor(previous, VOCAB)
        out.append(previous)
    return out


def _request(prompt_len, graphs, *, seed, fused, plain, draft_plain=3, capture_scale=1.0, capture_noise=0.0,
             gap_ours=0, input_shift=0.0, forced_shift=0.0, gather=2, fault=None):
    """One request's record as generate() returns it: the prefill, 23 verify forwards, the draft's forwards."""
    gen = torch.Generator().manual_seed(seed)
    captures = torch.randn(st.NEW_TOKENS, 1, 3 * 64, generator=gen)
    noise = torch.randn(st.NEW_TOKENS, 1, 3 * 64, generator=torch.Generator().manual_seed(seed + 1000))
    prompt = list(range(len(SPECIAL) + seed, len(SPECIAL) + seed + prompt_len))

    def forced(pos, k):
        return [{"pos": pos, "lp": -10.0 - 0.01 * k + forced_shift, "top": 100 + k, "top_lp": -9.0,
                 "lead": 0.5 if k % 2 else 0.05}]

    def counted(p, f):
        if graphs:
            return ({"sm120": 0, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0},
                    {"plain": p, "fused": f, "gather": gather, "kernel": p + f + gather})
        return ({"sm120": p, "sm120_fused": f, "fallback": 0, "fused_fallback": 0},
                {"plain": p, "fused": f, "gather": 0, "kernel": p + f})

    delta, device = counted(plain + fused, 0)
    forwards = [{"draft": False, "mode": "EXTEND", "tokens": prompt_len, "graph": False, "delta": delta,
                 "device": device, "fault": fault, "forced": forced(prompt_len - 1, 0)}]
    for k in range(st.NEW_TOKENS - 1):
        delta, device = counted(plain, fused)
        forwards.append({"draft": False, "mode": "TARGET_VERIFY", "tokens": 4, "graph": graphs, "delta": delta,
                         "device": device, "fault": fault, "forced": forced(prompt_len + k, k + 1),
                         "capture": _digest(captures[k] * capture_scale + capture_noise * noise[k])})
        if not graphs:
            forwards.append({"draft": True, "mode": "DECODE", "tokens": 1, "graph": False,
                             "delta": {"sm120": draft_plain, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0}})
    # the draft's extend of a prompt whose length the table gives to NCCL
    forwards.append({"draft": True, "mode": "EXTEND", "tokens": GAP_TOKENS, "graph": False,
                     "delta": {"sm120": gap_ours, "sm120_fused": 0, "fallback": 3 - gap_ours, "fused_fallback": 0}})
    return {"prompt_ids": prompt, "output_ids": _chain(prompt),
            "input_logprobs": [None] + [-9.0 - 0.1 * i + input_shift for i in range(prompt_len - 1)],
            "spec_verify_ct": 23, "spec_accepted_drafts": 0, "forwards": forwards}


def _run(mode, graphs, release="0.5.13.post1", *, shifts=None, faults_caught=True, **kw):
    """A run as serve() records it. `shifts`: per prompt index, extra keyword arguments of that prompt's request."""
    on = mode == "on"
    kw = {**COUNTS[release], **kw}
    requests = [_request(n, graphs, seed=i, **{**kw, **(shifts or {}).get(i, {})})
                for i, n in enumerate(st.PROMPT_WORDS)]
    run = {"mode": mode, "graphs": graphs, "requests": requests,
           "enabled_lines": ["ENABLED ... routes: tuned table /c/routes.json"] if on else [],
           "disabled_lines": [] if on else ["DISABLED"],
           # "on, graphs" measured the table, "on, eager" found it
           "tune_lines": ([f"written to {_table_path}; measuring took 40.0 s"] if graphs else
                          [f"a routing table of this box exists: {_table_path} (nothing measured)"]) if on else [],
           "info_after": [{"active": on, "max_bytes": 16 * ROW, "routes": {"path": _table_path if on else None}}],
           "device_calls": [1, 2, 3, 4, 5],
           "capture_guard_lines": ["[TP0] layers [1, 3, 5] feed", "[TP1] layers [1, 3, 5] feed"],
           "graph_capture_lines": ["Capture cuda graph end"] if graphs else [],
           "patch_lines": ["captured all-gather"], "bench_one_batch_server": {"returncode": 0}}
    if not graphs:
        armed = on and faults_caught
        run["negative_controls"] = {f: _faulted(f, armed, release) for f in st.negative_controls(release)}
    return run


def _faulted(fault, armed, release):
    """A negative control's request: as the fault leaves it where `armed`, else as "off" answers it."""
    kw = {**COUNTS[release], "seed": 10, "fault": fault if armed else None}
    if armed and fault == "shard_at_verify":  # the verify forwards' hidden states lose the peer's shard
        kw.update(forced_shift=2.0, capture_scale=1.8)
    if armed and fault == "capture_guard_off":  # the captures read partial sums; 3 MoE sums more deferred
        kw.update(capture_noise=0.3, fused=kw["fused"] + 3, plain=kw["plain"] - 3)
    return _request(9, False, **kw)


def _verdicts(runs, release="0.5.13.post1"):
    out = {}
    st._judge(runs, lambda name, ok, detail: out.__setitem__(name, ok), st.expected_counts(MODEL, release),
              MODEL, release)
    return out


def _failing(runs, release="0.5.13.post1"):
    return [k for k, v in _verdicts(runs, release).items() if not v]


def _only_these_fail(runs, picked, release="0.5.13.post1") -> None:
    """The checks `picked(name)` selects fail, at least one of them, and no other."""
    verdicts = _verdicts(runs, release)
    chosen = [k for k in verdicts if picked(k)]
    assert chosen and [k for k, v in verdicts.items() if not v] == chosen


def _on_both(change):
    """The same change to both "on" runs (they compute alike on 0.5.13.post1), "off" as it is."""
    return {"eager": change, "graphs": change}


def _three(release="0.5.13.post1", off=None, eager=None, graphs=None):
    return {"off, eager": _run("off", False, release, **(off or {})),
            "on, eager": _run("on", False, release, **(eager or {})),
            "on, graphs": _run("on", True, release, **(graphs or {}))}


@pytest.mark.parametrize("release", ["0.5.13.post1", "0.5.23"])
def test_a_good_run_passes_every_check(release):
    verdicts = _verdicts(_three(release), release)
    assert verdicts and all(verdicts.values()), [k for k, v in verdicts.items() if not v]
    assert sum(k.startswith("negative control") for k in verdicts) == len(st.negative_controls(release))


def test_a_server_routing_by_the_seeds_or_without_the_launchers_tune_fails():
    seeded = _run("on", False)
    seeded["enabled_lines"] = ["ENABLED ... routes: seeds, UNMEASURED on this box"]
    untuned = _run("on", True)
    untuned["tune_lines"] = []
    _only_these_fail({"on, eager": seeded, "on, graphs": untuned}, lambda k: "launcher" in k)


def test_two_on_servers_that_each_measured_their_own_table_fail():
    # each its own table: a size between measured ones may go to ours in one and to NCCL in the other, and the
    # outputs part there (an H200 run: the 5-token prompt's prefill, fused in one run, NCCL's in the other)
    runs = _three()
    runs["on, eager"]["tune_lines"] = [f"written to {_table_path}; measuring took 40.0 s"]
    _only_these_fail(runs, lambda k: "one table" in k)


@pytest.mark.parametrize("broken, failing", [
    ({"fused": 13, "plain": 6}, ("on, eager: every target-verify forward",)),  # a MoE sum not deferred
    ({"draft_plain": 2}, ("on, eager: every draft forward",)),
    ({"gap_ours": 3}, ("on, eager: every draft forward",)),  # ours where the table says NCCL
    # the graph server kept the right captures: eager against graphs parts too
    ({"capture_scale": 1.5}, ("on against off, per prompt: EAGLE-3 captures", "on, eager against on, graphs")),
])
def test_a_broken_eager_run_fails_its_check(broken, failing):
    runs = _three(eager=broken)
    _only_these_fail(runs, lambda k: k.startswith(failing))


def test_eager_device_counts_that_disagree_with_the_backends_fail():
    runs = _three()
    verify = st.verify_forwards(runs["on, eager"]["requests"])[5]
    verify["device"] = {**verify["device"], "kernel": verify["device"]["kernel"] + 1}
    _only_these_fail(runs, lambda k: k.startswith("on, eager: every target-verify"))


@pytest.mark.parametrize("change", [
    {"fused": 13},  # a replay ran a fused call less
    {"gather": 0},  # the logits all-gather not on our kernel
    {"kernel": 0},  # the kernels' own counter disagrees
    {"graph": False},  # the verify forward did not replay its graph
])
def test_a_graph_replay_with_the_wrong_calls_fails(change):
    runs = _three()
    verify = st.verify_forwards(runs["on, graphs"]["requests"])[7]
    if "graph" in change:
        verify["graph"] = False
    else:
        verify["device"] = {**verify["device"], **change}
    _only_these_fail(runs, lambda k: k.startswith("on, graphs: every target-verify"))


def test_one_prompts_fault_fails_per_prompt_where_a_pooled_bound_would_pass():
    # the 5-word prompt's 4 input logprobs a third of a nat off: 4 of 37 positions pooled (11%, the pooled median
    # unmoved) passes a pooled bound; that prompt's own median fails
    runs = _three(**_on_both({"shifts": {0: {"input_shift": 0.3}}}))
    pooled = [d for r_off, r_on in zip(runs["off, eager"]["requests"], runs["on, eager"]["requests"], strict=True)
              for d in st.compare_prompt(r_off, r_on)["input"]]
    assert st.spread(pooled, st.LOGPROB_MEDIAN_TOL, st.LOGPROB_OUTLIER_NATS, st.LOGPROB_OUTLIER_SHARE)["ok"]
    _only_these_fail(runs, lambda k: k.startswith("on against off, per prompt: teacher-forced input logprobs"))


def test_a_verify_forward_fault_fails_the_verify_logprobs_and_not_the_prefills():
    runs = _three(**_on_both({"shifts": {2: {"forced_shift": 0.5}}}))
    _only_these_fail(runs, lambda k: k.startswith("on against off, per prompt: teacher-forced logprobs of the "
                                                  "verify"))


def _on_runs_rows(runs, prompt):
    """The teacher-forced rows of one prompt, in both "on" runs, in order."""
    return [[row for f in runs[name]["requests"][prompt]["forwards"] for row in f.get("forced") or ()]
            for name in ("on, eager", "on, graphs")]


@pytest.mark.parametrize("rows_off, fails", [(4, False), (5, True)])
def test_a_prompt_may_have_a_fifth_of_its_rows_beyond_the_outlier_bound(rows_off, fails):
    runs = _three()
    for rows in _on_runs_rows(runs, 2):
        for row in rows[:rows_off]:  # of 24 rows, the median unmoved
            row["lp"] += 2 * st.LOGPROB_OUTLIER_NATS
    if fails:
        _only_these_fail(runs, lambda k: k.startswith("on against off, per prompt: teacher-forced logprobs of the "
                                                      "verify"))
    else:
        assert _failing(runs) == []


@pytest.mark.parametrize("accepted", [0, 1])
def test_a_verify_row_one_run_lacks_fails_unless_a_draft_was_accepted(accepted):
    runs = _three()
    for name in ("on, eager", "on, graphs"):
        request = runs[name]["requests"][1]
        request["forwards"].remove(st.verify_forwards([request])[6])
        request["spec_accepted_drafts"] = accepted
    if accepted:
        assert _failing(runs) == []
    else:
        _only_these_fail(runs, lambda k: k.startswith("on against off, per prompt: ")
                         and ("logprobs of the verify" in k or "captures" in k))


def test_an_argmax_parting_fails_only_where_the_reference_leads_clearly():
    runs = _three()

    def part(clearly: bool) -> None:
        for name in ("on, eager", "on, graphs"):
            rows = [f["forced"][0] for f in runs[name]["requests"][1]["forwards"] if f.get("forced")]
            row = next(r for r in rows if (r["lead"] > st.LOGPROB_OUTLIER_NATS) == clearly)
            row["top"] += 1

    part(clearly=False)
    assert _failing(runs) == []
    part(clearly=True)
    _only_these_fail(runs, lambda k: k.startswith("on against off") and "argmax" in k)


def test_the_capture_bound_sits_between_the_normal_spread_and_a_partial_sum():
    # per-forward noise of the size measured on against off passes; a partial sum's size fails
    assert _failing(_three(**_on_both({"capture_noise": 0.016}))) == []
    runs = _three(**_on_both({"capture_noise": 0.25}))
    _only_these_fail(runs, lambda k: k.startswith("on against off") and "captures" in k)


def test_a_broken_forcing_fails():
    runs = _three()
    runs["on, graphs"]["requests"][3]["output_ids"][5] += 1
    _only_these_fail(runs, lambda k: k.startswith("on, graphs: teacher forcing held"))


@pytest.mark.parametrize("release", ["0.5.13.post1", "0.5.23"])
def test_a_negative_control_the_checks_do_not_catch_fails(release):
    runs = _three(release, eager={"faults_caught": False})  # the faulted prompt answered as "off" answers it
    _only_these_fail(runs, lambda k: k.startswith("negative control"), release)


def test_a_negative_control_that_did_not_run_or_compares_nothing_fails():
    runs = _three()
    del runs["on, eager"]["negative_controls"]["capture_guard_off"]
    for f in runs["off, eager"]["negative_controls"]["shard_at_verify"]["forwards"]:
        f.pop("capture", None)  # nothing to compare: a missing number must not pass for a caught fault
    _only_these_fail(runs, lambda k: k.startswith("negative control"))


def test_the_release_sets_the_expected_counts():
    good = _run("on", False, "0.5.23")
    assert all(_verdicts({"on, eager": good}, "0.5.23").values())
    assert not all(_verdicts({"on, eager": good}, "0.5.13.post1").values())


def test_eager_against_graphs_is_identical_on_0_5_13_and_within_bounds_on_0_5_23():
    def failing(release, **graphs):
        return _failing({"on, eager": _run("on", False, release), "on, graphs": _run("on", True, release, **graphs)},
                        release)

    assert failing("0.5.13.post1") == []
    # the captures a tenth of a percent apart: 0.5.23 within its bounds, 0.5.13.post1 not identical
    assert failing("0.5.23", capture_noise=0.001) == []
    assert failing("0.5.13.post1", capture_noise=0.001) == [
        "on, eager against on, graphs: identical teacher-forced logprobs (prefill and verify), unforced argmax and "
        "EAGLE-3 captures, every prompt"]
    # captures off by half: outside 0.5.23's bounds too
    runs = {"on, eager": _run("on", False, "0.5.23"), "on, graphs": _run("on", True, "0.5.23", capture_scale=1.5)}
    _only_these_fail(runs, lambda k: k.startswith("on, graphs against on, eager") and "captures" in k, "0.5.23")
