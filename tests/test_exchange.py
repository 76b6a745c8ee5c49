"""The one agreement mechanism of a workspace (sgl_kernel_sm120/exchange.py): a round gathers every rank's outcome
and fails every rank together; a gloo group is wrapped so that its payloads are what a store-based exchange hands
back (JSON values)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from sgl_kernel_sm120.errors import IpcAllReduceError, IpcAllReduceHostMemoryError
from sgl_kernel_sm120.exchange import GlooExchange, agree, attempt, exchange_of
from tests.fake_ops import ThreadExchange, run_threads


def test_a_round_hands_back_every_rank_s_payload_in_rank_order():
    answers = run_threads(3, lambda rank, ex: agree(ex, "step", None, {"rank": rank, "pair": (rank, rank)}))
    assert answers == [[{"rank": r, "pair": [r, r]} for r in range(3)]] * 3  # JSON: a tuple comes back a list


def test_one_rank_s_failure_is_the_same_error_on_every_rank_naming_it():
    def step(rank, exchange):
        return agree(exchange, "the step", *attempt(lambda: 1 / (rank - 1)))

    answers = run_threads(3, step)
    assert all(isinstance(a, IpcAllReduceError) and not isinstance(a, IpcAllReduceHostMemoryError) for a in answers)
    assert {str(a) for a in answers} == {"IpcAllReduce the step failed (rank 1: ZeroDivisionError: division by zero)"}


def test_a_host_memory_shortfall_crosses_ranks_as_its_kind_with_its_sentence():
    sentence = "/dev/shm has 4.0 MiB free, the workspace needs 16.0 MiB"

    def step(rank, exchange):
        def size_check():
            if rank == 1:
                raise IpcAllReduceHostMemoryError(f"host memory: {sentence}", sentence)

        return agree(exchange, "size", *attempt(size_check))

    answers = run_threads(2, step)
    assert all(isinstance(a, IpcAllReduceHostMemoryError) and a.tmpfs == sentence for a in answers), answers
    assert {str(a) for a in answers} == {f"IpcAllReduce size failed (rank 1: IpcAllReduceHostMemoryError: host "
                                         f"memory: {sentence})"}


def _raise(exc: Exception):
    raise exc


def test_an_error_is_carried_by_its_kind_not_by_its_words():
    """A message that reads like a host-memory shortfall is a plain error when its type is not one, and a
    host-memory shortfall stays one however it is worded."""
    worded = RuntimeError("host memory: /dev/shm has 4.0 MiB free")
    answers = run_threads(2, lambda rank, ex: agree(ex, "words", *attempt(lambda: _raise(worded) if rank else 0)))
    assert all(type(a) is IpcAllReduceError for a in answers), answers
    typed = IpcAllReduceHostMemoryError("no room", "1 MiB free, 2 MiB needed")
    answers = run_threads(2, lambda rank, ex: agree(ex, "kind", *attempt(lambda: _raise(typed) if rank else 0)))
    assert all(isinstance(a, IpcAllReduceHostMemoryError) and a.tmpfs == "1 MiB free, 2 MiB needed"
               for a in answers), answers


@pytest.fixture
def one_rank_gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_gloo_group_is_wrapped_and_carries_json_as_a_store_would(one_rank_gloo_group):
    exchange = exchange_of(one_rank_gloo_group)
    assert isinstance(exchange, GlooExchange) and (exchange.rank, exchange.world_size) == (0, 1)
    assert exchange.all_gather({"handle": b"\x01\xff".hex(), "sizes": (1, 2)}) == [{"handle": "01ff", "sizes": [1, 2]}]
    exchange.barrier(5.0)
    with pytest.raises(TypeError):  # not JSON: refused here as a store-based exchange would
        exchange.all_gather({b"key"})


def test_an_exchange_is_taken_as_it_is():
    exchange = ThreadExchange.group(1)[0]
    assert exchange_of(exchange) is exchange
