"""Benchmark models (issue 6 groundwork): the published parameter counts, shapes, channels_last."""

import pytest
import torch

from distrun.bench.models import build, parameter_count, resnet50


@pytest.mark.parametrize("name, expected", [("resnet50", 25_557_032), ("resnet18", 11_689_512)])
def test_parameter_counts_are_the_published_ones(name, expected):
    assert parameter_count(build(name)) == expected


def test_resnet50_is_v1_5_stride_on_the_3x3():
    block = resnet50().layer2[0]
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)


@pytest.mark.parametrize("name, size", [("resnet50", 64), ("resnet18", 32), ("mlp", 32)])
def test_forward_and_backward_on_small_images(name, size):
    torch.manual_seed(0)
    model = build(name, num_classes=10) if name != "mlp" else build(name, num_classes=10, image_size=size)
    x = torch.randn(2, 3, size, size).to(memory_format=torch.channels_last)
    out = model.to(memory_format=torch.channels_last)(x)
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unknown_models_are_named():
    with pytest.raises(ValueError, match="unknown model 'vgg'; known: resnet50, resnet18, mlp"):
        build("vgg")


@pytest.mark.parametrize(("outer", "own", "expected"), [
    (torch.bfloat16, None, torch.bfloat16),  # distrun's strategy.run autocasts around the step
    (None, torch.bfloat16, torch.bfloat16),  # the hand-written baseline autocasts itself
    (None, None, torch.float32),
])
def test_the_benchmark_step_keeps_the_callers_autocast(outer, own, expected):
    """An ``autocast(enabled=False)`` inside the step switched distrun's bf16 off: ResNet-50
    ran in fp32 under distrun against a bf16 baseline (0.65x on an H100)."""
    from distrun.bench import _scaling_workload as workload

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    seen = []
    model.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    optimizer = workload.make_optimizer(model)
    step = workload.make_step(model, optimizer, torch.randn(2, 8), torch.tensor([0, 1]), autocast=own)
    if outer is None:
        step()
    else:
        with torch.autocast("cpu", dtype=outer):
            step()
    assert seen == [expected]
