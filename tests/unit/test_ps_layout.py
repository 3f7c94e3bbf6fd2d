"""The parameter-server layout both ends derive alone, and the packing of messages."""

import pytest
import torch
from torch import nn

from distrun.config import JobSpec, StrategyName
from distrun.errors import ConfigError
from distrun.strategies.ps.layout import Layout, flat_specs, pack, unpack_into


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(1000, 8)  # 32 KB: split at a 16 KB threshold
        self.proj = nn.Linear(8, 4000)  # 128 KB weight: split too, but not an embedding: dense
        self.head = nn.Linear(4000, 1)


def test_a_big_embedding_is_sparse_and_a_big_linear_is_split_but_dense():
    layout = Layout(Tower(), num_tasks=2, partition_bytes=16 << 10)
    assert layout.sparse_names == {"embedding.weight"}
    assert {ref.name for ref in layout.refs if ref.shard.rows} == {"embedding.weight", "proj.weight"}
    assert [ref.shard.rows for ref in layout.shards_of("embedding.weight")] == [(0, 500), (500, 1000)]
    assert all(not ref.sparse for ref in layout.dense(0) + layout.dense(1))
    assert layout.shard_shape(layout.shards_of("proj.weight")[1]) == (2000, 8)
    # Every element of every parameter is owned exactly once.
    owned = sum(torch.Size(layout.shard_shape(ref)).numel() for ref in layout.refs)
    assert owned == sum(p.numel() for p in Tower().parameters())
    assert layout.describe()[0].startswith("ps0: ") and "embedding.weight[0:500]" in layout.describe()[0]


def test_layout_is_the_same_on_every_process():
    a, b = Layout(Tower(), 3, 16 << 10), Layout(Tower(), 3, 16 << 10)
    assert a.refs == b.refs


def test_pack_groups_by_dtype_and_unpacks_exactly():
    tensors = [torch.randn(3, 2), torch.arange(5), torch.randn(4), torch.arange(2)]
    flats = pack(tensors)
    assert [(f.numel(), f.dtype) for f in flats] == flat_specs([t.shape for t in tensors], [t.dtype for t in tensors])
    targets = [torch.empty_like(t) for t in tensors]
    unpack_into(flats, targets)
    assert all(torch.equal(t, u) for t, u in zip(tensors, targets))


def test_ps_spec_fields_and_the_alias(tmp_path):
    recipe = str(tmp_path / "r.py")
    spec = JobSpec.of(recipe=recipe, strategy=StrategyName.parse("ps"), replicas=3, ps_tasks=2)
    assert spec.strategy.name is StrategyName.PARAMETER_SERVER and spec.world_size == 5
    assert not spec.strategy.name.collective and StrategyName.MIRRORED.collective
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="needs at least one ps task"):
        JobSpec.of(recipe=recipe, strategy=StrategyName.PARAMETER_SERVER, replicas=2)
    with pytest.raises(ConfigError, match="--ps-tasks is for --strategy parameter-server"):
        JobSpec.of(recipe=recipe, strategy=StrategyName.MIRRORED, replicas=2, ps_tasks=1)
