"""--async-checkpoint copies the shards behind training: a real ShardedStrategy on a one-rank
gloo group, a real DCP save, and an optimizer step taken at once after it. The step must wait
for the copy (the optimizer's pre-hook), so the checkpoint holds the values of the step it was
taken at, never the next step's; a buffer a forward changes is cloned at once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distrun.strategies import load_checkpoint, latest_checkpoint
from distrun.strategies.base import ReplicaInfo
from distrun.strategies.sharded import ShardedStrategy


def _whole(value):
    return value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()


class Reporter:
    during = None

    def __init__(self) -> None:
        self.saves: list[tuple[int, float]] = []

    def checkpoint(self, step: int, path: str, blocked_ms: float) -> None:
        self.saves.append((step, blocked_ms))

    def __getattr__(self, name):  # the other progress calls: not what this test reads
        return lambda *args, **kwargs: None


class Model(nn.Module):
    """In state-dict order: 64 MB of frozen weights, the small layer that trains, the norm's
    buffers; a forward runs the norm first. The copy reaches the small layer and the buffers
    only after the 64 MB, long after a step (or a forward's first op) would change them."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(4096, 4096).requires_grad_(False)
        self.small = nn.Linear(4096, 64)
        self.norm = nn.BatchNorm1d(4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.big(self.norm(x)))


def _saved(strategy, folder) -> dict:
    strategy.wait_for_checkpoint()
    return load_checkpoint(latest_checkpoint(folder))["model"]


def test_a_save_copies_behind_training_and_still_holds_its_own_step(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        reporter = Reporter()
        strategy = ShardedStrategy(ReplicaInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")),
                                   reporter, async_checkpoint=True)
        torch.manual_seed(0)
        with strategy.scope():
            model = Model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        model, optimizer = strategy.prepare(model, optimizer)
        batch = torch.randn(8, 4096)
        model(batch).square().mean().backward()
        optimizer.step()
        model(batch).square().mean().backward()  # the next step's gradients, ready before the save

        # The optimizer step right after a save waits for the copy.
        strategy.step = 1
        expected = {key: _whole(value) for key, value in strategy.unwrap().state_dict().items()}
        strategy.save(tmp_path / "ck")
        copying = strategy._staging._staged  # noqa: SLF001 - the copy in flight (None: this torch copies at once)
        optimizer.step()
        assert copying is None or copying.done(), "the optimizer step did not wait for the copy in flight"
        saved = _saved(strategy, tmp_path / "ck")
        for key, value in expected.items():
            assert torch.equal(saved[key], value), f"{key}: the checkpoint of step 1 holds the next step's"

        # A forward right after a save changes the buffers at once: the save cloned them first.
        strategy.step = 2
        expected = {key: _whole(value) for key, value in strategy.unwrap().state_dict().items()}
        strategy.save(tmp_path / "ck")
        model(batch)
        saved = _saved(strategy, tmp_path / "ck")
        for key in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
            assert torch.equal(saved[key], expected[key]), f"{key}: the checkpoint of step 2 holds a later forward's"
        assert [step for step, _ in reporter.saves] == [1, 2] and all(ms > 0 for _, ms in reporter.saves)

        # A save that must be whole on return (the run's last, with nothing to write it behind):
        # written straight from the model, no copy, published and reported before it returns.
        strategy.step = 3
        expected = {key: _whole(value) for key, value in strategy.unwrap().state_dict().items()}
        staged = strategy._staging._staged  # noqa: SLF001 - the last copy started (step 2's)
        path = strategy.save(tmp_path / "ck", wait=True)
        assert strategy._pending_save is None and strategy._staging._staged is staged  # noqa: SLF001 - no copy made
        assert path is not None and path == latest_checkpoint(tmp_path / "ck") and reporter.saves[-1][0] == 3
        saved = load_checkpoint(path)["model"]
        for key, value in expected.items():
            assert torch.equal(saved[key], value), key
        strategy.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
