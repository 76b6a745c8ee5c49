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


def _run(mode, graphs, fused=14, plain=5, draft_plain=3, capture_scale=1.0):
    captures = torch.randn(24, 1, 3 * 64, generator=torch.Generator().manual_seed(2))
    forwards = []
    for k in range(23):
        forwards.append({"draft": False, "mode": "TARGET_VERIFY", "tokens": 4, "graph": graphs,
                         "delta": {"sm120": plain, "sm120_fused": fused, "fallback": 0, "fused_fallback": 0},
                         "capture": _digest(captures[k] * capture_scale)})
        forwards.append({"draft": True, "mode": "DECODE", "tokens": 1, "graph": graphs,
                         "delta": {"sm120": draft_plain, "sm120_fused": 0, "fallback": 0, "fused_fallback": 0}})
    request = {"output_ids": list(range(24)), "input_logprobs": [None, -1.0, -2.0, -3.0], "spec_verify_ct": 23,
               "spec_accepted_drafts": 0, "forwards": forwards}
    on = mode == "on"
    return {"mode": mode, "graphs": graphs, "requests": [copy.deepcopy(request) for _ in st.PROMPTS],
            "enabled_lines": ["ENABLED ... routes: tuned table /c/routes.json"] if on else [],
            "disabled_lines": [] if on else ["DISABLED"],
            "tune_lines": ["written to /c/routes.json; measuring took 40.0 s"] if on else [],
            "info_after": [{"active": on}], "device_calls": [1, 2, 3, 4, 5],
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
    assert [k for k, v in verdicts.items() if not v] == [k for k in verdicts if "launcher's tune" in k]


@pytest.mark.parametrize("broken, failing", [
    ({"fused": 13, "plain": 6}, "every target-verify forward"),  # a MoE sum not deferred
    ({"draft_plain": 2}, "every draft forward"),
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
