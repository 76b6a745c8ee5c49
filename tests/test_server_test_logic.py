"""The real-server test's own logic on CPU (tests/gpu/test_sglang_server.py): its command line parses with the
installed SGLang's own parser, and its verdicts pass a good synthetic run and fail broken ones."""

from __future__ import annotations

import argparse
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from tests.gpu import server_patches as sp  # noqa: E402
from tests.gpu import test_sglang_server as st  # noqa: E402

MODEL = {"target": "/m/target", "draft": "/m/draft", "layers": 9, "first_k_dense": 1, "eagle_layer_ids": [1, 3, 5]}
ROW = st.HIDDEN * 2
GAP_TOKENS = 5  # between the measured 4 and 8 rows, whose winners differ: NCCL's
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


def _run(mode, graphs, fused=14, plain=5, draft_plain=3, capture_scale=1.0, gap_ours=0):
    captures = torch.randn(24, 1, 3 * 64, generator=torch.Generator().manual_seed(2))
    forwards = []
    for k in range(23):
        forwards.append({"draft": False, "mode": "TARGET_VERIFY", "tokens": 4, "graph": graphs,
                         "delta": {"sm120": plain, "sm120_fused": fused, "fallback": 0, "fused_fallback": 0},
                         "capture": _digest(captures[k] * capture_scale)})
        forwards.append({"draft": True, "mode": "DECODE", "tokens": 1, "graph": graphs,
                         "delta": {"sm120": draft_plain, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0}})
    # the draft's extend of a prompt whose length the table gives to NCCL
    forwards.append({"draft": True, "mode": "EXTEND", "tokens": GAP_TOKENS, "graph": graphs,
                     "delta": {"sm120": gap_ours, "sm120_fused": 0, "fallback": 3 - gap_ours, "fused_fallback": 0}})
    request = {"output_ids": list(range(24)), "input_logprobs": [None, -1.0, -2.0, -3.0], "spec_verify_ct": 23,
               "spec_accepted_drafts": 0, "forwards": forwards}
    on = mode == "on"
    return {"mode": mode, "graphs": graphs, "requests": [copy.deepcopy(request) for _ in st.PROMPTS],
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


def _verdicts(runs, release="0.5.13.post1"):
    out = {}
    st._judge(runs, lambda name, ok, detail: out.__setitem__(name, ok), st.expected_counts(MODEL, release),
              MODEL, release)
    return out


def test_a_good_run_passes_every_check():
    verdicts = _verdicts({"off, eager": _run("off", False), "on, eager": _run("on", False),
                          "on, graphs": _run("on", True)})
    assert verdicts and all(verdicts.values()), [k for k, v in verdicts.items() if not v]


def test_a_server_routing_by_the_seeds_or_without_the_launchers_tune_fails():
    seeded = _run("on", False)
    seeded["enabled_lines"] = ["ENABLED ... routes: seeds, UNMEASURED on this box"]
    untuned = _run("on", True)
    untuned["tune_lines"] = []
    verdicts = _verdicts({"on, eager": seeded, "on, graphs": untuned})
    assert [k for k, v in verdicts.items() if not v] == [k for k in verdicts if "launcher" in k]


def test_two_on_servers_that_each_measured_their_own_table_fail():
    # each its own table: a size between measured ones may go to ours in one and to NCCL in the other, and the
    # outputs part there (an H200 run: the 5-token prompt's prefill, fused in one run, NCCL's in the other)
    eager = _run("on", False)
    eager["tune_lines"] = [f"written to {_table_path}; measuring took 40.0 s"]
    verdicts = _verdicts({"off, eager": _run("off", False), "on, eager": eager, "on, graphs": _run("on", True)})
    assert [k for k, v in verdicts.items() if not v] == [k for k in verdicts if "one table" in k]


@pytest.mark.parametrize("broken, failing", [
    ({"fused": 13, "plain": 6}, "every target-verify forward"),  # a MoE sum not deferred
    ({"draft_plain": 2}, "every draft forward"),
    ({"gap_ours": 3}, "every draft forward"),  # ours where the table says NCCL
    ({"capture_scale": 1.5}, "EAGLE-3 captures"),
])
def test_a_broken_eager_run_fails_its_check(broken, failing):
    verdicts = _verdicts({"off, eager": _run("off", False), "on, eager": _run("on", False, **broken),
                          "on, graphs": _run("on", True)})
    assert [k for k, v in verdicts.items() if not v] == [k for k in verdicts if failing in k]


def test_the_release_sets_the_expected_counts():
    good = _run("on", False, fused=17, plain=2)
    assert all(_verdicts({"on, eager": good}, "0.5.23").values())
    assert not all(_verdicts({"on, eager": good}, "0.5.13.post1").values())


def test_eager_against_graphs_is_identical_on_0_5_13_and_within_bounds_on_0_5_23():
    counts = {"0.5.23": {"fused": 17, "plain": 2}, "0.5.13.post1": {"fused": 14, "plain": 5}}

    def failing(release, capture_scale, last_token):
        graphs = _run("on", True, capture_scale=capture_scale, **counts[release])
        for request in graphs["requests"]:
            request["output_ids"][-1] = last_token
        runs = {"on, eager": _run("on", False, **counts[release]), "on, graphs": graphs}
        return [k for k, v in _verdicts(runs, release).items() if not v]

    # the last greedy token parts, the captures within a percent: 0.5.23 within its bounds, 0.5.13.post1 not
    assert failing("0.5.23", 1.01, 99) == []
    assert failing("0.5.13.post1", 1.0, 99) == ["on, eager against on, graphs: identical greedy outputs"]
    # captures off by half: outside 0.5.23's bounds too
    assert any("on, graphs against on, eager: EAGLE-3 captures" in k for k in failing("0.5.23", 1.5, 23))
