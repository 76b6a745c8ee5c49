"""The store exchange a workspace's construction runs its steps over: ranks are threads sharing a c10d HashStore."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from sglang_sm120.core import exchange


def _ranks(world, body):
    results, errors = {}, []

    def run(rank):
        try:
            results[rank] = body(rank)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return results


def test_every_step_gathers_every_ranks_object_in_rank_order_under_its_own_keys():
    store = dist.HashStore()

    def steps(rank):
        ex = exchange.StoreExchange(store, "build:a", rank, 3, timeout_s=5.0)
        first = ex.all_gather({"rank": rank})
        ex.barrier()
        return first, ex.all_gather(rank * 10)

    out = _ranks(3, steps)
    assert all(v == ([{"rank": 0}, {"rank": 1}, {"rank": 2}], [0, 10, 20]) for v in out.values())


def test_a_step_a_rank_never_reaches_names_that_rank_within_its_bound():
    store = dist.HashStore()

    def alone(rank):
        ex = exchange.StoreExchange(store, "build:b", rank, 3, timeout_s=60.0)
        with pytest.raises(exchange.ExchangeTimeout, match=r"no answer from ranks \[2\] within 0s"):
            ex.barrier(timeout_s=0.2)
        return True

    assert _ranks(2, alone) == {0: True, 1: True}
