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


# The order and the initial parameters come from the CPU generator whatever device
# trains. CI has no GPU, so the "other device" here is a non-CPU default device
# (meta): anything that drew from the default device would fail or differ under it.

@pytest.mark.parametrize("default_device", ["meta", "cpu"])
def test_the_epoch_order_is_drawn_on_the_cpu_whatever_the_default_device(default_device):
    expected = GlobalBatchPlan(97, 16, 2, seed=5).order(3)
    with torch.device(default_device):
        assert GlobalBatchPlan(97, 16, 2, seed=5).order(3) == expected


class _Quiet:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _initial_parameters(device: torch.device) -> dict[str, torch.Tensor]:
    from distrun.strategies import OneDeviceStrategy, ReplicaInfo

    strategy = OneDeviceStrategy(ReplicaInfo(rank=0, world_size=1, local_rank=0, device=device, seed=0), _Quiet())
    torch.manual_seed(11)
    with torch.device("meta"), strategy.scope():  # an outer default device does not leak in
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    return model.state_dict()


def test_models_are_built_on_the_cpu_for_any_device_so_the_seed_gives_the_same_init():
    on_cpu = _initial_parameters(torch.device("cpu"))
    for_cuda = _initial_parameters(torch.device("cuda", 0))  # built, not moved: no GPU needed
    assert all(t.device.type == "cpu" for t in for_cuda.values())
    for key, tensor in on_cpu.items():
        assert torch.equal(for_cuda[key], tensor), key


def _replicas(num_replicas, dataset, seen):
    from distrun.strategies.data.plan import DistributedDataset

    return [DistributedDataset(dataset, 16, num_replicas=num_replicas, replica_id=r, seed=3,
                               on_batch=lambda n, w, r=r: seen.append((r, n, w)), any_exhausted=lambda _: False)
            for r in range(num_replicas)]


def test_a_reshard_splits_the_same_global_batches_over_the_survivors():
    """Elastic membership: 3 replicas lose one in the step of batch 4. The two left redo that
    batch and go on; every global batch is the one-device batch, split 3 ways then 2."""
    dataset = torch.utils.data.TensorDataset(torch.arange(100))
    one = [b[0].tolist() for b in _replicas(1, dataset, [])[0]]
    seen: list = []
    three = _replicas(3, dataset, seen)
    iters = [iter(d) for d in three]
    got = [sorted(sum((next(it)[0].tolist() for it in iters), [])) for _ in range(5)]  # batch 4 fails
    survivors = [three[0], three[2]]
    for new_rank, replica in enumerate(survivors):
        replica.reshard(2, new_rank, redo_last=True)
        assert replica.position == (0, 4)
    del got[4]
    iters = [iter(d) for d in survivors]
    seen.clear()
    for _ in range(len(one) - 4):
        got.append(sorted(sum((next(it)[0].tolist() for it in iters), [])))
    assert got == [sorted(batch) for batch in one]
    # The last global batch (4 samples) splits 2 + 2: each share weighs its size over the global size, x 2.
    assert [(n, w) for _, n, w in seen[-2:]] == [(2, 1.0), (2, 1.0)]
    with pytest.raises(StopIteration):
        next(iters[0])


def test_an_iterable_dataset_cannot_be_resharded():
    from distrun.strategies.data.plan import DistributedDataset

    stream = DistributedDataset(iter(range(10)), 4, num_replicas=2, replica_id=0, seed=0,
                                on_batch=lambda n, w: None, any_exhausted=lambda _: False)
    with pytest.raises(TypeError, match="cannot be resplit"):
        stream.reshard(1, 0, redo_last=False)
