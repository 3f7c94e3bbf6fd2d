"""`--strategy sharded` (FSDP2 on gloo, CPU): one-device's parameters, checkpoints every
strategy reads, the units it shards, and one-line refusals."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


def _train(recipe, ckpt, strategy, *extra, replicas="2"):
    more = [] if strategy == "one-device" else ["--replicas", replicas]
    result = run_cli("train", str(recipe), "-s", strategy, *more, "--json", "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, load_checkpoint(latest_checkpoint(ckpt))


def _close(a, b, what):
    for key, tensor in b.items():
        torch.testing.assert_close(a[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


@pytest.mark.parametrize("replicas, batch", [("2", "16"), ("3", "18")])
def test_sharded_ends_with_one_devices_parameters(write_recipe, tmp_path, replicas, batch):
    """99 samples: a last global batch of 3 (split 2 + 1 over two ranks) or of 9 (3 each over three)."""
    recipe = write_recipe(EQUIV)
    flags = ("--epochs", "2", "--global-batch-size", batch, "--", "--samples", "99")
    base, one = _train(recipe, tmp_path / "one", "one-device", *flags)
    result, sharded = _train(recipe, tmp_path / "sh", "fsdp", *flags, replicas=replicas)
    assert sharded["step"] == one["step"] == 2 * -(-99 // int(batch)) and sharded["strategy"] == "sharded"
    _close(sharded["model"], one["model"], "sharded vs one-device")
    assert result.summary["final_loss"] == pytest.approx(base.summary["final_loss"], rel=1e-4)
    assert result.summary["eval_metrics"]["accuracy"] == pytest.approx(base.summary["eval_metrics"]["accuracy"])
    # Each rank's peak memory (the process's peak RSS on CPU) reaches the summary.
    peaks = result.summary["peak_mem_mb"]
    assert sorted(peaks) == [str(rank) for rank in range(int(replicas))] and all(mb > 50 for mb in peaks.values())
    # What it sharded, said once: the Sequential's two Linear blocks, then the root.
    picked = [line for line in result.json_lines() if line["type"] == "output" and "[sharded]" in line["line"]]
    assert len(picked) == 1 and "2 Linear block(s)" in picked[0]["line"], picked
    # Each rank wrote its own shards into the checkpoint's folder; read whole, it is the plain format.
    folder = latest_checkpoint(tmp_path / "sh")
    assert folder.is_dir() and sorted(p.name for p in folder.glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(int(replicas))]
    assert set(sharded["model"]) == set(one["model"])
    assert all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in sharded["model"].values())
    assert sorted(sharded["optimizer"]["state"]) == [0, 1, 2, 3]


def test_a_custom_loop_prepares_a_sharded_model_and_optimizer():
    """recipes/custom_loop.py unchanged: the same losses as mirrored (rank 0 reports its own share)."""
    runs = {strategy: run_cli("train", str(REPO / "recipes" / "custom_loop.py"), "-s", strategy, "--replicas", "2",
                              "--json") for strategy in ("mirrored", "sharded")}
    for strategy, result in runs.items():
        assert result.returncode == 0, f"{strategy}: {result.stderr[-3000:]}"
    mirrored, sharded = runs["mirrored"].summary, runs["sharded"].summary
    assert sharded["steps"] == mirrored["steps"] == 24  # 3 epochs of 8 global batches
    assert sharded["final_loss"] == pytest.approx(mirrored["final_loss"], rel=1e-4)


def test_the_recipe_names_its_units_and_bf16_trains(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV + "\n\ndef shard_units(model):\n    return [model[0]]\n")
    result, data = _train(recipe, tmp_path / "bf16", "sharded", "--steps", "30", "--precision", "bf16",
                          "--no-reshard-after-forward")
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "[sharded]" in line["line"]]
    assert said and "1 unit(s) named by the recipe's shard_units: 0" in said[0], said
    assert all(t.dtype == torch.float32 for t in data["model"].values())  # fp32 master weights
    losses = [line["loss"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("flags, says", [
    (["--compression", "bf16"], "--compression bf16 with --strategy sharded"),
    (["--elastic", "1:2"], "--elastic: for --strategy mirrored, multi-worker or diloco"),
    (["--async-checkpoint"], "--async-checkpoint needs --checkpoint-dir"),
    (["--offload", "cpu", "--device", "cpu"], "--offload cpu with --strategy sharded"),
])
def test_what_does_not_combine_is_refused_in_one_line(write_recipe, flags, says):
    result = run_cli("train", str(write_recipe(EQUIV)), "-s", "sharded", "--replicas", "2", *flags)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("flag", [["--shard-within", "host"], ["--async-checkpoint"]])
def test_sharded_flags_belong_to_sharded(write_recipe, flag):
    result = run_cli("train", str(write_recipe(EQUIV)), "-s", "mirrored", *flag)
    assert result.returncode == 2 and f"{flag[0]} is for --strategy sharded" in result.stderr, result.stderr


BIG = """
import torch
from torch import nn

from distrun.runtime._reporter import peak_rss_mb


def main(strategy):
    with strategy.scope():  # three 4096 x 4096 layers: 50M parameters, 200 MB in fp32
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(3)])
    built_on = next(model.parameters()).device.type
    model, _ = strategy.prepare(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    print(f"rank {strategy.replica_id}: built on {built_on}, holds {local} values, peak {peak_rss_mb():.0f} MB",
          flush=True)
"""


def test_only_rank_0_ever_holds_the_whole_model(write_recipe):
    """The others build it on the meta device and allocate only their shards: their peak stays
    below rank 0's by about the model's size (200 MB), which rank 0 alone built whole."""
    result = run_cli("train", str(write_recipe(BIG)), "-s", "sharded", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    said = {int(line["line"].split(":")[0].split()[1]): line["line"] for line in result.json_lines()
            if line["type"] == "output" and line["line"].startswith("rank ")}
    assert "built on cpu" in said[0] and "built on meta" in said[1], said
    half = (3 * (4096 * 4096 + 4096)) // 2
    assert all(f"holds {half} values" in line for line in said.values()), said
    peak = {rank: float(line.rsplit("peak ", 1)[1].split()[0]) for rank, line in said.items()}
    assert peak[0] - peak[1] > 120, peak
