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
