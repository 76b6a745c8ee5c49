"""scripts/p2p_fingerprint.py: its judgements with injected numbers, and its copy kernel on CPU through Triton's
interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "p2p_fingerprint.py")
spec = importlib.util.spec_from_file_location("p2p_fingerprint", SCRIPT)
fabric = sys.modules["p2p_fingerprint"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
spec.loader.exec_module(fabric)
Fingerprint = fabric.Fingerprint

KB = 1024


@pytest.mark.parametrize("store, load, verdict", [
    (2.6, 27.0, "posted-write collapse"),  # the b12x box
    (25.4, 18.0, "stores beat loads"),
    (20.0, 22.0, "balanced"),
    (None, 22.0, "unknown"),
    (0.0, 22.0, "unknown"),
])
def test_the_store_load_ratio_names_the_collapse(store, load, verdict):
    assert fabric.ratio_verdict(store, load)[1] == verdict


def test_a_copy_time_growing_at_host_speed_is_driver_staged():
    sizes = [4 * KB, 16 * KB, 64 * KB, 114 * KB]
    staged = [10 + s / 0.48e3 for s in sizes]  # ~0.48 GB/s marginal: 242 us at 114 KB
    g = fabric.growth(sizes, staged)
    assert g["staged"] and 0.4 < g["marginal_gbps"] < 0.6
    healthy = [6 + s / 25e3 for s in sizes]  # 25 GB/s after a ~6 us launch
    assert not fabric.growth(sizes, healthy)["staged"]
    flat_but_slow = [300, 301, 302, 303]  # slow, but not growing with size: not staging
    assert not fabric.growth(sizes, flat_but_slow)["staged"]
    with pytest.raises(ValueError):
        fabric.growth([4 * KB], [1.0])


def pair(src, dst, store, load, latency=0.8, copy=None):
    return {"src": src, "dst": dst, "store_gbps": store, "load_gbps": load, "latency_us": latency,
            "copy_us": copy or {4096: 6.0, 65536: 8.6, 262144: 16.0}}


def test_statements_name_the_collapse_with_all_peers_and_the_pairs():
    fp = Fingerprint([0, 1, 2], [pair(0, 1, 2.6, 27.0), pair(1, 0, 20.0, 21.0)],
                     {"store_gbps": 3.1, "load_gbps": 26.0})
    said = fabric.statements(fp)
    assert said[0].startswith("posted-write collapse: with every GPU writing to all its peers at once, SM stores "
                              "reach 3.1 GB/s per GPU against 26.0 GB/s") and "pull ones are not affected" in said[0]
    assert said[1] == "posted-write collapse between single pairs too (1 of 2: 0->1)"


def test_statements_name_a_driver_staged_pair_first():
    staged = {4096: 12.0, 16384: 40.0, 65536: 145.0, 262144: 560.0}
    fp = Fingerprint([0, 1], [pair(0, 1, 20, 21, copy=staged), pair(1, 0, 20, 21)], {"store_gbps": 20, "load_gbps": 21})
    said = fabric.statements(fp)
    assert len(said) == 1 and said[0].startswith("P2P from cuda:0 to cuda:1 is driver-staged: a copy takes 12.0 us "
                                                 "at 4096 B and 560.0 us at 262144 B")


def test_a_healthy_fabric_is_said_to_be_one():
    fp = Fingerprint([0, 1], [pair(0, 1, 20, 21), pair(1, 0, 21, 20)], {"store_gbps": 19, "load_gbps": 20})
    assert fabric.statements(fp) == ["no posted-write collapse and no driver-staged P2P seen"]
    lines = fabric.report_lines(fp)
    assert lines[0] == ("cuda:0 -> cuda:1: SM store 20.0 GB/s, SM load 21.0 GB/s (ratio 0.95, balanced); one-way flag "
                        "latency 0.80 us; copy 4096 B 6.0 us, 65536 B 8.6 us, 262144 B 16.0 us")
    assert lines[2].startswith("all peers at once, per GPU: SM store 19.0 GB/s")


def test_missing_measurements_are_shown_as_unknown_with_the_errors():
    fp = Fingerprint.from_dict({"gpus": [0, 1], "pairs": [{"src": 0, "dst": 1}], "all_peers": {},
                                "errors": ["latency 0->1: RuntimeError: 200 of 200 flag waits gave up"]})
    lines = fabric.report_lines(fp)
    assert "SM store ? GB/s" in lines[0] and "unknown" in lines[0]
    assert "error: latency 0->1: RuntimeError: 200 of 200 flag waits gave up" in lines


def test_the_probes_copy_kernel_copies_on_cpu_under_tritons_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        f"import sys; sys.path.insert(0, {os.path.dirname(SCRIPT)!r})\n"
        "import p2p_fingerprint as p\n"
        "copy, _ = p._kernels()\n"
        "n = 3 * p.BLOCK + 17\n"
        "src, dst = torch.arange(n, dtype=torch.float32), torch.zeros(n)\n"
        "copy[(p.triton_cdiv(n, p.BLOCK),)](src, dst, n, BLOCK=p.BLOCK)\n"
        "assert torch.equal(src, dst), 'copy differs'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
