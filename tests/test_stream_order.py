"""I6's rule (csrc/ar_protocol.cuh; stream_step in csrc/ar_launch.h), checked on the host: tests/stream_order_check.cu
is compiled with the header and run. It walks the sequences of streams SGLang makes (warm-ups and captures on its
capture streams, then serving on its forward stream), the tuner's lanes, a capture on a side stream, one capture
over two streams, eager calls alternating between two streams, and an eager call while the previous eager stream
captures, and fails unless each call goes on, is ordered after the right stream, or is refused exactly as the rule
says, and unless serving from one stream asks CUDA nothing. The GPU scenarios of tests/gpu/test_ipc_allreduce.py run
the same cases on real streams."""

from __future__ import annotations

from tests.host_check import run_host_check


def test_the_stream_rule_orders_every_change_refuses_only_the_unorderable_and_passes_sglang(tmp_path):
    run_host_check("stream_order_check", tmp_path)
