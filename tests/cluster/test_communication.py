"""--allreduce hierarchical and --compression across namespace hosts: 2 hosts x 2 slots, gloo."""

from __future__ import annotations

from pathlib import Path

import torch

from distrun.strategies import latest_checkpoint
from tests.cluster.conftest import Lab, brought_up, json_lines, lab_cli
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

FULL_BATCHES = ("--", "--samples", "96")  # global batch 16: 4 samples per replica, no partial batch


def _params(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(latest_checkpoint(ckpt), weights_only=True)["model"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_hierarchical_equals_flat_equals_one_device_on_two_hosts_of_two_slots(lab: Lab, tmp_path: Path) -> None:
    recipe = tmp_path / "code" / "equiv.py"
    recipe.parent.mkdir()
    recipe.write_text(EQUIV)
    local = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(tmp_path / "one"), "--steps", "12",
                    *FULL_BATCHES)
    assert local.returncode == 0, local.stderr[-2000:]
    one = _params(tmp_path / "one")
    roles = {"h1": {"roles": "[chief, worker]", "slots": "2"}, "h2": {"roles": "[worker]", "slots": "2"}}
    with brought_up(lab, roles, "hier") as cluster:
        runs = {}
        for name, flags in (("flat", ()), ("hierarchical", ("--allreduce", "hierarchical")),
                            ("hierarchical-bf16", ("--allreduce", "hierarchical", "--compression", "bf16")),
                            ("auto", ("--allreduce", "auto"))):
            result = lab_cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker",
                             "--json", "--no-fetch", "--checkpoint-dir", str(tmp_path / name), "--steps", "12",
                             *flags, *FULL_BATCHES, timeout=240)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            lines = json_lines(result)
            assert lines[0]["world_size"] == 4
            runs[name] = (lines[-1], _params(tmp_path / name))
            if name == "auto":
                chosen = [line for line in lines if line["type"] == "allreduce"]
    summary, hierarchical = runs["hierarchical"]
    assert summary["allreduce"] == "hierarchical" and runs["flat"][0]["allreduce"] == "flat"
    # The same sums in another order: float rounding only (Adam steps of lr 0.01, 12 of them).
    for key, tensor in one.items():
        torch.testing.assert_close(hierarchical[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(runs["flat"][1][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    summary, compressed = runs["hierarchical-bf16"]
    assert summary["compression"] == "bf16"
    assert 0 < _max_diff(compressed, one) <= 12 * 0.01 * 2.0**-8
    # auto measured both on this job's buckets (2 hosts x 2 ranks), kept one, and said why.
    print(chosen)
    assert len(chosen) == 1 and chosen[0]["rank"] == 0
    assert chosen[0]["flat_ms"] > 0 and chosen[0]["hierarchical_ms"] > 0
    summary, auto = runs["auto"]
    assert summary["allreduce"] == chosen[0]["algorithm"] in ("flat", "hierarchical")
    assert summary["allreduce_reason"].startswith("measured: ") and "2 hosts x 2 ranks" in summary["allreduce_reason"]
    for key, tensor in one.items():
        torch.testing.assert_close(auto[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
