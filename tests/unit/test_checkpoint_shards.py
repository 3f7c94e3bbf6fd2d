"""Sharded checkpoint folders (DCP inside): the layout of tensors and JSON, publishing, listing
beside plain files, and loading that runs no code. DCP itself is real here, in one process."""

from __future__ import annotations

import os
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distrun.errors import CheckpointError
from distrun.strategies.checkpoint import (
    latest_checkpoint,
    layout,
    list_checkpoints,
    load_checkpoint,
    prune,
    save_checkpoint,
    shards,
)
from distrun.strategies.checkpoint.rng import rng_from_json, rng_state, rng_to_json

# DCP warns that no process group means one process: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _named_optimizer(model, optimizer):
    names = [name for name, _ in model.named_parameters()]
    return layout.named(optimizer.state_dict(), names)


def _write(folder, step, model, optimizer, **meta):
    tensors, rest = layout.split(model.state_dict(), _named_optimizer(model, optimizer))
    shards.prepare(folder, step)
    dcp.save(tensors, checkpoint_id=shards.temporary_path(folder, step), no_dist=True)
    return shards.commit(folder, step, {"step": step, "rng": rng_to_json(rng_state()), **rest, **meta})


def test_split_and_join_keep_every_tensor_and_the_groups_as_json():
    model, optimizer = _model_and_optimizer()
    named = _named_optimizer(model, optimizer)
    tensors, rest = layout.split(model.state_dict(), named)
    assert sorted(k for k in tensors if k.startswith("model/")) == sorted(f"model/{k}" for k in model.state_dict())
    assert "optim/0.weight/exp_avg" in tensors and "optim/1.bias/step" in tensors
    assert rest["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.9]  # JSON: the tuple is a list
    model_state, back = layout.join(tensors, rest)
    assert model_state.keys() == model.state_dict().keys()
    again = layout.indexed(back)
    original = optimizer.state_dict()
    assert again["state"].keys() == original["state"].keys()
    for index, state in original["state"].items():
        for key, value in state.items():
            assert torch.equal(again["state"][index][key], value)
    # torch's optimizer takes it back.
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    fresh.load_state_dict(again)
    assert fresh.param_groups[0]["lr"] == 0.1


def test_a_value_neither_tensor_nor_json_is_refused_by_name():
    with pytest.raises(CheckpointError, match=r"optimizer state w\.lr_fn: builtin_function_or_method is neither a tensor nor JSON"):
        layout.split({}, {"state": {"w": {"lr_fn": len}}, "param_groups": []})


def test_rng_states_survive_json():
    random.seed(7)
    torch.manual_seed(7)
    saved = rng_to_json(rng_state())
    expected = (torch.rand(3), random.random())
    back = rng_from_json(saved)
    torch.set_rng_state(back["torch"])
    random.setstate((back["python"][0], tuple(back["python"][1]), back["python"][2]))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_a_published_folder_reads_back_whole_and_lists_beside_plain_files(tmp_path):
    model, optimizer = _model_and_optimizer()
    save_checkpoint(tmp_path, 1, {"model": model.state_dict(), "optimizer": {}, "step": 1})
    path = _write(tmp_path, 2, model, optimizer, strategy="sharded", num_replicas=4)
    assert path.name == "ckpt-000000002" and (path / "distrun.json").is_file()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert latest_checkpoint(tmp_path) == path
    data = load_checkpoint(path)
    assert data["step"] == 2 and data["strategy"] == "sharded" and data["num_replicas"] == 4
    for key, tensor in model.state_dict().items():
        assert torch.equal(data["model"][key], tensor)
    assert data["optimizer"]["state"].keys() == optimizer.state_dict()["state"].keys()
    assert isinstance(data["rng"]["torch"], torch.Tensor) and data["rng"]["torch"].dtype == torch.uint8
    prune(tmp_path, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000002"]


def test_an_unpublished_folder_is_not_a_checkpoint_and_the_next_save_removes_it(tmp_path):
    model, optimizer = _model_and_optimizer()
    _write(tmp_path, 1, model, optimizer)
    tensors, _ = layout.split(model.state_dict(), None)
    shards.prepare(tmp_path, 2)  # a save killed after every rank wrote, before rank 0 published
    dcp.save(tensors, checkpoint_id=shards.temporary_path(tmp_path, 2), no_dist=True)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    _write(tmp_path, 3, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001", "ckpt-000000003"]


def test_publishing_names_shards_that_are_not_there(tmp_path):
    model, optimizer = _model_and_optimizer()
    tensors, _ = layout.split(model.state_dict(), None)
    shards.prepare(tmp_path, 1)
    dcp.save(tensors, checkpoint_id=shards.temporary_path(tmp_path, 1), no_dist=True)
    (shards.temporary_path(tmp_path, 1) / "__0_0.distcp").unlink()  # as if written on another host
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*--checkpoint-dir every host shares"):
        shards.commit(tmp_path, 1, {"step": 1})
    assert list_checkpoints(tmp_path) == []


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/distrun-pwned",))


def test_an_index_that_would_run_code_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _write(tmp_path, 1, model, optimizer)
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match=r"refused: posix\.system is not part of a checkpoint index"):
        load_checkpoint(path)
    assert not os.path.exists("/tmp/distrun-pwned")


def test_an_index_that_would_rewrite_an_admitted_class_is_refused(tmp_path):
    """BUILD with (None, {attribute: value}) on a class sets the class's attributes for the whole
    process; the index may name the class (paths are in every index), never change it."""
    import pathlib

    model, optimizer = _model_and_optimizer()
    path = _write(tmp_path, 1, model, optimizer)
    before = pathlib.PurePosixPath.__doc__
    (path / ".metadata").write_bytes(b"cpathlib\nPurePosixPath\n(N}S'__doc__'\nS'rewritten'\nstb.")
    with pytest.raises(CheckpointError, match="refused: sets the attributes of the class PurePosixPath"):
        load_checkpoint(path)
    assert pathlib.PurePosixPath.__doc__ == before


def test_a_checkpoint_holding_pickled_objects_is_refused(tmp_path):
    """DCP itself would unpickle a non-tensor entry with weights_only=False; distrun never writes one."""
    shards.prepare(tmp_path, 1)
    dcp.save({"model/w": torch.ones(2), "evil": {"not": "a tensor"}},
             checkpoint_id=shards.temporary_path(tmp_path, 1), no_dist=True)
    with pytest.raises(CheckpointError, match=r"holds pickled objects \(evil\.not\)"):
        shards.commit(tmp_path, 1, {"step": 1})  # never published...
    path = tmp_path / "ckpt-000000001"  # ...nor loaded, when someone else publishes it
    shards.temporary_path(tmp_path, 1).rename(path)
    (path / "distrun.json").write_text('{"format": "%s", "step": 1}' % shards.FORMAT)
    with pytest.raises(CheckpointError, match=r"holds pickled objects \(evil\.not\)"):
        load_checkpoint(path)
