"""The exactness check: its inputs and its expected results (against the kernel package's reference)."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_sm120 import reference_all_reduce, reference_all_reduce_add_rmsnorm
from sglang_sm120.tuning import verify


def bank(kind, dtype, rows, hidden, world, cases=3):
    return verify.SizeBank(kind, dtype, rows, hidden, world, range(world), "cpu", cases)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_expected_results_are_the_references_exactly(dtype):
    plain, fused = bank("plain", dtype, 3, 7168, 8), bank("fused", dtype, 5, 7168, 4)
    for case in range(3):
        given = [plain.x[r][case] for r in range(8)]
        assert verify.mismatch("sum", reference_all_reduce(given), plain.expected[case, 0]) is None
        ref_norm, ref_res = reference_all_reduce_add_rmsnorm([fused.x[r][case] for r in range(4)],
                                                             fused.residual[case], fused.weight, fused.eps)
        assert verify.mismatch("norm", ref_norm, fused.expected[case, 0]) is None
        assert verify.mismatch("residual", ref_res, fused.expected[case, 1]) is None


def test_inputs_are_small_integers_with_negative_zeros_and_differ_by_rank_and_case():
    x0, x1 = verify.rank_input(0, 0, 4, 1024, "bfloat16"), verify.rank_input(0, 1, 4, 1024, "bfloat16")
    values = x0.float()
    assert torch.equal(values, values.round()) and values.abs().max() <= 3
    negative_zeros = int(((values == 0) & torch.signbit(values)).sum())
    assert negative_zeros > 100
    assert not torch.equal(x0, x1) and not torch.equal(x0, verify.rank_input(1, 0, 4, 1024, "bfloat16"))
    assert torch.equal(x0, verify.rank_input(0, 0, 4, 1024, "bfloat16"))  # every rank can rebuild it


def test_a_wrong_value_or_a_nan_is_named_and_counted():
    total = bank("plain", "bfloat16", 2, 64, 2).expected[0, 0]
    wrong = total.clone()
    wrong[1, 5] += 1
    assert "1 of 128 elements differ, first at [1, 5]" in verify.mismatch("sum", wrong, total)
    assert verify.wrong_elements(wrong.unsqueeze(0), total.unsqueeze(0)).tolist() == [1]
    wrong = total.clone()
    wrong[0, 0] = float("nan")
    assert "first at [0, 0]" in verify.mismatch("sum", wrong, total)
    assert verify.wrong_elements(wrong.unsqueeze(0), total.unsqueeze(0)).tolist() == [1]
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
    total = bank("plain", "bfloat16", 2, 64, 2).expected[0, 0]
    wrong = total.clone()
    wrong[0, 3] += 1
    text = verify.mismatch("sum", OnAnotherDevice(wrong), OnAnotherDevice(total))
    assert "1 of 128 elements differ, first at [0, 3]" in text


def test_the_fingerprint_sees_the_sign_of_zero_and_any_one_bit():
    a = torch.zeros(8, dtype=torch.bfloat16)
    assert int(verify.fingerprint(a)) != int(verify.fingerprint(-a))
    assert verify.mismatch("zero", -a, a) is None  # as values they are equal
    x = verify.rank_input(0, 0, 4, 64, "bfloat16")
    for i in (0, 17, 255):
        flipped = x.clone().view(torch.int16).reshape(-1)
        flipped[i] ^= 1
        assert int(verify.fingerprint(x)) != int(verify.fingerprint(flipped.view(torch.bfloat16).reshape(x.shape)))


def test_the_fused_case_needs_a_hidden_size_in_fours_and_a_kernel_dtype():
    with pytest.raises(ValueError):
        bank("fused", "bfloat16", 1, 6, 2)
    with pytest.raises(ValueError):
        verify.rank_input(0, 0, 1, 8, "float32")
