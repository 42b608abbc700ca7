"""A launched decode step's results brought to the host: the accepted lengths and the greedy
chain's reach travel in one copy, as the rows of one tensor."""

from __future__ import annotations

import torch

from specserve.runtime.worker import PendingDecode, rows_of_one


def test_rows_of_one_tensor_are_viewed_not_copied_and_equal_a_stack():
    counts = torch.randint(0, 9, (2, 7))
    for n in (7, 3, 1):
        first, second = counts[0][:n], counts[1][:n]
        both = rows_of_one(first, second)
        assert torch.equal(both, torch.stack((first, second)))
        assert both.data_ptr() == counts.data_ptr()  # (a view of the step's own tensor)


def test_tensors_that_are_not_rows_of_one_are_stacked():
    a, b = torch.arange(5), torch.arange(5, 10)
    assert torch.equal(rows_of_one(a, b), torch.stack((a, b)))
    base = torch.arange(8)
    overlapping = rows_of_one(base[0:5], base[3:8])  # (one storage, but the rows overlap)
    assert torch.equal(overlapping, torch.stack((base[0:5], base[3:8])))
    assert overlapping.data_ptr() != base.data_ptr()
    strided = torch.arange(20).view(2, 10)[:, ::2]  # (rows with a stride of 2)
    assert torch.equal(rows_of_one(strided[0], strided[1]), strided)


def test_a_pending_steps_result_reports_each_requests_tokens_and_reach():
    counts = torch.tensor([[2, 1, 3, 9], [1, 0, 2, 9]])  # (the last row is padding)
    emitted = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 4], [0, 0, 0]])
    n = 3
    out = PendingDecode(
        [object()] * n, counts[0][:n], emitted[:n], chain_reach=counts[1][:n]
    ).result()
    assert out.accept_lens == [2, 1, 3]
    assert out.chain_reach == [1, 0, 2]
    assert out.emitted == [[5, 6], [7], [8, 9, 4]]
