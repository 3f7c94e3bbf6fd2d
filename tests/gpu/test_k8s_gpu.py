"""`export k8s --gpus-per-pod 1` trains on the GPU: the pod's command, run here with the pod's
environment (tests/integration/test_k8s_export.py's ``Pods``), ends with one-device's CUDA
parameters; and `--sync-batch-norm` on CUDA keeps torch's own SyncBatchNorm (the CPU module is
for gloo). One GPU: one pod of one rank (two pods would need a GPU each)."""

from __future__ import annotations

import json

import pytest

from tests.gpu.test_cuda import assert_same_params, checkpoint, train
from tests.integration.test_k8s_export import Pods, _container, _export, _finish
from tests.integration.test_sync_batch_norm import BATCH_NORM

pytestmark = pytest.mark.gpu


def test_a_gpu_pod_trains_on_cuda_to_one_devices_parameters(tmp_path):
    objects = _export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker]}\n", "--gpus-per-pod", "1",
                      "--checkpoint-dir", "/ckpt", "--checkpoint-pvc", "c", validate=False)
    job = next(obj for obj in objects if obj["kind"] == "Job")
    assert _container(job)["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    spec = json.loads(next(obj for obj in objects if obj["kind"] == "ConfigMap")["data"]["job-spec.json"])
    assert spec["strategy"]["device"] == "cuda"
    events = _finish(Pods(objects, tmp_path, tmp_path / "ckpt").start())
    started = [event for event in events if event.get("type") == "started"]
    assert [event["device"][:4] for event in started] == ["cuda"], started  # the pod's one rank, on its GPU
    assert [event["steps"] for event in events if event.get("type") == "done"] == [12]
    train(tmp_path / "job" / "equiv.py", tmp_path / "alone", "--device", "cuda", "--steps", "12")
    assert_same_params(checkpoint(tmp_path / "alone"), checkpoint(tmp_path / "ckpt"), "k8s pod on cuda")


def test_sync_batch_norm_on_cuda_is_torchs_and_trains(write_recipe, tmp_path):
    recipe = write_recipe(BATCH_NORM)
    train(recipe, tmp_path / "sync", "--strategy", "mirrored", "--replicas", "1", "--device", "cuda",
          "--sync-batch-norm", "--epochs", "2")
    train(recipe, tmp_path / "one", "--device", "cuda", "--epochs", "2")
    assert_same_params(checkpoint(tmp_path / "one"), checkpoint(tmp_path / "sync"), "--sync-batch-norm x1 on cuda")
