"""DiLoCo's parts without a job: its flags' refusals, fragments of whole units and their steps, the
outer optimizer, and the wire's means on a real two-process gloo group."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import multiprocessing as mp
from torch import nn

from distrun.config import JobSpec, StrategyName
from distrun.errors import ConfigError
from distrun.strategies.local_sgd.fragments import split_fragments
from distrun.strategies.local_sgd.outer import GlobalWeights


def _spec(**fields) -> JobSpec:
    return JobSpec.of(recipe="/r.py", strategy=StrategyName.DILOCO, replicas=2, **fields)


@pytest.mark.parametrize("fields, says", [
    ({"sync_every": 0}, "--sync-every: expected a positive number"),
    ({"outer_lr": 0.0}, "--outer-lr: expected a positive learning rate"),
    ({"outer_momentum": 1.0}, "--outer-momentum: expected 0"),
    ({"sync_dtype": "int9"}, "did you mean"),
    ({"fragments": 5, "sync_every": 4}, "at most 4 fragments"),
    ({"checkpoint_every": 150, "checkpoint_dir": "/c"}, "give a multiple of --sync-every 100"),
    ({"compression": "bf16"}, "--compression with --strategy diloco: diloco's replicas exchange no gradients"),
    ({"elastic_min": 1, "elastic_max": 2, "fragments": 2}, "--elastic with --strategy diloco: with --fragments"),
    ({"tp": 2}, "--tp with --strategy diloco"),
])
def test_diloco_flags_are_refused_in_one_line(fields, says):
    with pytest.raises(ConfigError, match=None) as caught:
        _spec(**fields)
    assert says in caught.value.message and "\n" not in caught.value.message


def test_diloco_flags_belong_to_diloco():
    with pytest.raises(ConfigError, match="--sync-every is for --strategy diloco"):
        JobSpec.of(recipe="/r.py", strategy=StrategyName.MIRRORED, replicas=2, sync_every=10)
    spec = _spec(sync_every=10, checkpoint_every=30, checkpoint_dir="/c")
    assert JobSpec.from_json(spec.to_json()) == spec


def test_fragments_hold_whole_units_in_order_and_spread_their_syncs():
    model = nn.Sequential(nn.Embedding(10, 4), *[nn.Linear(4, 4) for _ in range(5)], nn.LayerNorm(4))
    fragments = split_fragments(model, list(model)[1:6], 3, 12)
    # The embedding goes with the first unit, the final norm with the last.
    assert fragments.indices == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert [fragments.due(step) for step in range(1, 13)] == [[], [], [], [0], [], [], [], [1], [], [], [], [2]]
    assert sorted(sum(split_fragments(model, list(model)[1:6], 5, 5).indices, [])) == list(range(13))
    assert all(split_fragments(model, list(model)[1:6], 5, 5).indices)
    whole = split_fragments(model, (), 1, 7)
    assert whole.indices == [list(range(13))] and whole.due(7) == [0] and whole.due(6) == []
    with pytest.raises(ConfigError, match="--fragments 6: the model has 5 unit"):
        split_fragments(model, list(model)[1:6], 6, 12)


def test_the_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    weights = GlobalWeights([param], lr=0.5, momentum=0.9)
    with torch.no_grad():
        param.sub_(torch.tensor([0.2, 0.4]))  # the replica's inner steps
    mean = weights.pseudo_gradient([0], [param])
    torch.testing.assert_close(mean[0], torch.tensor([0.2, 0.4]))
    weights.step([0], mean)
    # Nesterov's first step: buffer = g, update = g + 0.9 g.
    torch.testing.assert_close(weights.tensors[0].detach(), torch.tensor([1.0, 2.0]) - 0.5 * 1.9 * mean[0])
    weights.copy_into([0], [param], keep_local=0.5)
    torch.testing.assert_close(param.detach(), 0.5 * torch.tensor([0.8, 1.6]) + 0.5 * weights.tensors[0].detach())
    plain = GlobalWeights([nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.0)
    assert plain.optimizer.defaults["nesterov"] is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _means(rank: int, port: int, queue) -> None:
    from distrun.strategies.local_sgd.wire import PseudoGradientWire

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(rank)
    values = [[torch.randn(37, generator=gen) * 3, torch.randn(5, 4, generator=gen) * 0.01] for _ in range(6)]
    out = {}
    for dtype in ("fp32", "bf16", "int8"):
        wire = PseudoGradientWire(dtype, members=2, rank=rank)
        means, costs = [], []
        for tensors in values:
            mean, cost = wire.mean(0, tensors)
            means.append([m.clone() for m in mean])
            costs.append(cost.bytes_sent)
        out[dtype] = (means, costs)
    lists = {dtype: ([[m.tolist() for m in mean] for mean in means], costs) for dtype, (means, costs) in out.items()}
    queue.put((rank, [[t.tolist() for t in tensors] for tensors in values], lists))
    dist.destroy_process_group()


def test_the_wire_averages_and_feeds_its_rounding_back():
    """Two gloo processes: fp32 is the exact mean; bf16 and int8 are within their rounding of
    it at each sync, every replica gets the same values, and thanks to error feedback the sum
    over six syncs is within one sync's rounding of the true sum (the error is not lost)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_means, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict((rank, (values, out)) for rank, values, out in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    values = [[[torch.tensor(t) for t in tensors] for tensors in results[r][0]] for r in range(2)]
    truth = [[(a + b) / 2 for a, b in zip(values[0][s], values[1][s])] for s in range(6)]
    for dtype, tolerance in (("fp32", 1e-6), ("bf16", 0.02), ("int8", 0.06)):
        got0, costs = [[torch.tensor(m) for m in mean] for mean in results[0][1][dtype][0]], results[0][1][dtype][1]
        got1 = [[torch.tensor(m) for m in mean] for mean in results[1][1][dtype][0]]
        for s in range(6):
            for t in range(2):
                torch.testing.assert_close(got0[s][t], got1[s][t], rtol=0, atol=0)  # the same everywhere
                scale = truth[s][t].abs().max().item()
                assert (got0[s][t] - truth[s][t]).abs().max().item() <= tolerance * scale + 1e-6, (dtype, s, t)
        total_error = max((sum(g[t] for g in got0) - sum(x[t] for x in truth)).abs().max().item() for t in range(2))
        one_sync = max((got0[0][t] - truth[0][t]).abs().max().item() for t in range(2))
        assert total_error <= 2 * one_sync + 1e-6, (dtype, total_error, one_sync)
        elements = 37 + 20
        expected = {"fp32": 4 * elements, "bf16": 2 * elements}.get(dtype)
        if expected is not None:
            assert costs[0] == expected
        else:  # int8: a byte per element to the peer, twice, plus the scales
            assert elements <= costs[0] < 2 * elements + 64
