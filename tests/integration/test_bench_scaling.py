"""`distrun bench resnet50|resnet18|mlp`: the scaling report (tiny CPU runs; figures in docs/benchmarks.md)."""

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.integration

#: The environment of a run that must see no GPU, on a GPU machine too: distrun counts the GPUs in
#: /proc/driver/nvidia/gpus limited by CUDA_VISIBLE_DEVICES (distrun/launch/_devices.py), and "" leaves none.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.bench
def test_a_tiny_resnet50_run_reports_rows_and_the_ddp_ratio(tmp_path):
    plot = tmp_path / "scaling.png"
    result = run_cli("bench", "resnet50", "--device", "cpu", "--replicas", "2", "--image-size", "32", "--batch", "2",
                     "--steps", "2", "--warmup", "1", "--compare", "ddp", "--json", "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"] == "resnet50" and report["parameters"] == 25_557_032 and report["device"] == "cpu"
    assert [row["replicas"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["images_per_s"] > 0
        assert row["images_per_s_per_replica"] == pytest.approx(row["images_per_s"] / row["replicas"])
    one = report["rows"][0]["images_per_s"]
    assert report["rows"][0]["scaling_efficiency"] == pytest.approx(1.0)
    assert report["rows"][1]["scaling_efficiency"] == pytest.approx(report["rows"][1]["images_per_s"] / (2 * one))
    assert report["ddp_images_per_s"] > 0
    assert report["vs_ddp"] == pytest.approx(report["rows"][1]["images_per_s"] / report["ddp_images_per_s"])
    assert report["reference_efficiency"] == [0.9, 0.95]
    # 2 timed steps of a 32-pixel batch of 2 last far under a second: said, in one line
    assert report["note"].startswith("too short to measure: at 1 replica(s) 2 timed steps took"), report["note"]
    assert report["rows"][0]["too_short"]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_replica_counts_double_up_to_the_maximum():
    from distrun.bench.scaling import replica_counts

    assert replica_counts(1) == [1] and replica_counts(8) == [1, 2, 4, 8] and replica_counts(6) == [1, 2, 4, 6]


def test_more_gpus_than_the_machine_has_is_a_clear_error():
    result = run_cli("bench", "resnet50", "--gpus", "8", env=NO_GPU)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --gpus 8: found 0 GPU(s) on this machine")


@pytest.mark.parametrize("args, message", [
    (("--compare", "horovod"), "--compare: only `ddp` is built"),
    (("--batch", "0"), "--batch: expected a positive whole number"),
    (("--gpus", "1", "--device", "cpu"), "--gpus 1: found 0 GPU(s)"),
])
def test_bad_scaling_flags_are_named(args, message):
    result = run_cli("bench", "resnet18", *args, env=NO_GPU)
    assert result.returncode == 2 and message in result.stderr


def test_the_rate_comes_from_the_median_step_and_a_short_or_warming_window_is_said():
    from distrun.bench._scaling_workload import rate

    settled = rate([0.2] * 9 + [0.9], images_per_step=8)  # one slow step (a stray warm-up) does not count
    assert settled["images_per_s"] == pytest.approx(40.0) and settled["too_short"] is None
    warming = rate([0.4, 0.35, 0.3, 0.2, 0.2, 0.2], images_per_step=8)  # its first half slower: still warming
    assert "ran 75% slower than the rest (still warming up)" in warming["too_short"]
    short = rate([0.05] * 6, images_per_step=8)
    assert short["too_short"] == "6 timed steps took 0.30 s (under 1 s)"
