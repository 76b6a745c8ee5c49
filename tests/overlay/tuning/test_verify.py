"""The exactness check: its inputs and its expected results (against the kernel package's reference)."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_sm120 import reference_all_reduce, reference_all_reduce_add_rmsnorm
from sglang_sm120.tuning import verify


def plain_total(world, rows, hidden, dtype="bfloat16"):
    return verify.CallBank("plain", dtype, rows, hidden, world, range(world), "cpu").expected(0)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("value", [0, 1, verify.salt("sm120/ONESHOT/push/device")])
def test_the_expected_results_are_the_references_exactly(dtype, value):
    plain = verify.CallBank("plain", dtype, 3, 7168, 8, range(8), "cpu")
    given = plain.inputs(value)["x"]
    assert verify.mismatch("sum", reference_all_reduce([given[r] for r in range(8)]), plain.expected(value)[0]) is None
    fused = verify.CallBank("fused", dtype, 5, 7168, 4, range(4), "cpu")
    given = fused.inputs(value)
    norm, res = fused.expected(value)
    ref_norm, ref_res = reference_all_reduce_add_rmsnorm([given["x"][r] for r in range(4)], given["residual"],
                                                         fused.weight, fused.eps)
    assert verify.mismatch("norm", ref_norm, norm) is None
    assert verify.mismatch("residual", ref_res, res) is None


def test_inputs_are_small_integers_with_negative_zeros_and_differ_by_rank():
    x0, x1 = verify.rank_input(0, 4, 1024, "bfloat16"), verify.rank_input(1, 4, 1024, "bfloat16")
    values = x0.float()
    assert torch.equal(values, values.round()) and values.abs().max() <= 3
    negative_zeros = int(((values == 0) & torch.signbit(values)).sum())
    assert negative_zeros > 100
    assert not torch.equal(x0, x1)
    assert torch.equal(x0, verify.rank_input(0, 4, 1024, "bfloat16"))  # every rank can rebuild it


def test_a_wrong_value_or_a_nan_is_named():
    total = plain_total(2, 2, 64)
    wrong = total.clone()
    wrong[1, 5] += 1
    assert "1 of 128 elements differ, first at [1, 5]" in verify.mismatch("sum", wrong, total)
    wrong = total.clone()
    wrong[0, 0] = float("nan")
    assert "first at [0, 0]" in verify.mismatch("sum", wrong, total)
    assert "shape/dtype" in verify.mismatch("sum", total.half(), total)


class OnAnotherDevice:
    """A tensor as the tuner holds it on the GPU: usable only once moved to the CPU (a GPU tune's mismatch report
    once compared a moved output with an expected value left on the GPU, and raised instead of naming it)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def detach(self):
        return self

    def to(self, device):
        assert device == "cpu"
        return self.tensor


def test_a_difference_between_device_tensors_is_named_on_the_cpu():
    total = plain_total(2, 2, 64)
    wrong = total.clone()
    wrong[0, 3] += 1
    text = verify.mismatch("sum", OnAnotherDevice(wrong), OnAnotherDevice(total))
    assert "1 of 128 elements differ, first at [0, 3]" in text


def test_the_fingerprint_sees_the_sign_of_zero_and_any_one_bit():
    a = torch.zeros(8, dtype=torch.bfloat16)
    assert verify.fingerprint([a]) != verify.fingerprint([-a])
    assert verify.mismatch("zero", -a, a) is None  # as values they are equal
    x = verify.rank_input(0, 4, 64, "bfloat16")
    for i in (0, 17, 255):
        flipped = x.clone().view(torch.int16).reshape(-1)
        flipped[i] ^= 1
        assert verify.fingerprint([x]) != verify.fingerprint([flipped.view(torch.bfloat16).reshape(x.shape)])


def test_the_fused_case_needs_a_hidden_size_in_fours():
    with pytest.raises(ValueError):
        verify.CallBank("fused", "bfloat16", 1, 6, 2, range(2), "cpu").inputs(0)
    with pytest.raises(ValueError):
        verify.rank_input(0, 1, 8, "float32")
