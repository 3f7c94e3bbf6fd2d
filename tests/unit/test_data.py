import pytest
import torch

from distrun.strategies import GlobalBatchPlan


@pytest.mark.parametrize("n, gbs", [(100, 16), (97, 16), (33, 8), (5, 4)])
def test_replicas_split_exactly_the_one_device_batches(n, gbs):
    one = GlobalBatchPlan(n, gbs, 1, seed=3)
    order = one.order(epoch=2)
    for replicas in (2, 4):
        plan = GlobalBatchPlan(n, gbs, replicas, seed=3)
        assert plan.order(2) == order
        for b in range(plan.batches_per_epoch):
            whole = one.share(order, b, 0)
            shares = [plan.share(order, b, r) for r in range(replicas)]
            real = [i for s in shares for i in s.indices[: s.real]]
            assert real == list(whole.indices)
            # Loss weights make the averaged gradient the global mean's.
            assert sum(s.weight_factor for s in shares) == pytest.approx(1.0)


def test_an_empty_share_gets_one_padding_sample_of_weight_zero():
    plan = GlobalBatchPlan(9, 8, 4, seed=0)
    order = plan.order(0)
    last = [plan.share(order, 1, r) for r in range(4)]
    assert [s.real for s in last] == [1, 0, 0, 0]
    assert all(len(s.indices) == 1 for s in last)
    assert [s.weight_factor for s in last] == [1.0, 0.0, 0.0, 0.0]


def test_each_epoch_has_its_own_permutation_and_seed_matters():
    plan = GlobalBatchPlan(50, 10, 2, seed=1)
    assert plan.order(0) != plan.order(1)
    assert sorted(plan.order(1)) == list(range(50))
    assert GlobalBatchPlan(50, 10, 2, seed=2).order(0) != plan.order(0)


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="train_data is empty"):
        GlobalBatchPlan(0, 4, 1, seed=0)


def test_order_does_not_touch_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    GlobalBatchPlan(10, 2, 1, seed=0).order(0)
    assert torch.equal(torch.rand(1), expected)
