"""The exactness check: its inputs and its expected results (against the kernel package's reference)."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_sm120 import reference_all_reduce, reference_all_reduce_add_rmsnorm
from sglang_sm120.tuning import verify


def exact(got, expected) -> bool:
    """Equal values, zero tolerance (+0 == -0 as values), no NaN; dtypes and shapes alike."""
    return got.dtype == expected.dtype and got.shape == expected.shape and \
        not int(verify.wrong_elements(got.unsqueeze(0), expected.unsqueeze(0)).sum())


def bank(kind, dtype, rows, hidden, world, cases=3):
    return verify.SizeBank(kind, dtype, rows, hidden, world, range(world), "cpu", cases)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_expected_results_are_the_references_exactly(dtype):
    plain, fused = bank("plain", dtype, 3, 7168, 8), bank("fused", dtype, 5, 7168, 4)
    for case in range(3):
        given = [plain.x[r][case] for r in range(8)]
        assert exact(reference_all_reduce(given), plain.expected[case, 0])
        ref_norm, ref_res = reference_all_reduce_add_rmsnorm([fused.x[r][case] for r in range(4)],
                                                             fused.residual[case], fused.weight, fused.eps)
        assert exact(ref_norm, fused.expected[case, 0]) and exact(ref_res, fused.expected[case, 1])


def test_inputs_are_small_integers_with_negative_zeros_and_differ_by_rank_and_case():
    x0, x1 = verify.rank_input(0, 0, 4, 1024, "bfloat16"), verify.rank_input(0, 1, 4, 1024, "bfloat16")
    values = x0.float()
    assert torch.equal(values, values.round()) and values.abs().max() <= 3
    negative_zeros = int(((values == 0) & torch.signbit(values)).sum())
    assert negative_zeros > 100
    assert not torch.equal(x0, x1) and not torch.equal(x0, verify.rank_input(1, 0, 4, 1024, "bfloat16"))
    assert torch.equal(x0, verify.rank_input(0, 0, 4, 1024, "bfloat16"))  # every rank can rebuild it


def test_a_wrong_value_or_a_nan_is_counted_per_call():
    total = bank("plain", "bfloat16", 2, 64, 2).expected[:2, 0]  # two calls' sums
    wrong = total.clone()
    wrong[1, 1, 5] += 1
    wrong[0, 0, 0] = float("nan")
    assert verify.wrong_elements(wrong, total).tolist() == [1, 1]
    assert verify.wrong_elements(total, total).tolist() == [0, 0]


def test_the_fingerprint_sees_the_sign_of_zero_and_any_one_bit():
    a = torch.zeros(8, dtype=torch.bfloat16)
    assert int(verify.fingerprint(a)) != int(verify.fingerprint(-a))
    assert exact(-a, a)  # as values they are equal
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
