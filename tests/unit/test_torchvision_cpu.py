"""torchvision as scripts/setup.sh installs it: PyPI's wheel with the
operator library that scripts/torchvision_cpu builds for CPU torch. It
imports (the vision-language processors need it), declares torchvision's
operators, runs nms as a plain greedy NMS does, and refuses the detection
ops it has no kernel for."""

from __future__ import annotations

import pytest
import torch

torchvision = pytest.importorskip("torchvision")


def _greedy_nms(boxes: torch.Tensor, scores: torch.Tensor, iou: float) -> list[int]:
    """Reference: highest score first, drop every box overlapping a kept one
    by more than ``iou`` (intersection over union), in float64."""
    b = boxes.double()
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    keep: list[int] = []
    for i in order:
        ok = True
        for j in keep:
            w = (torch.min(b[i, 2], b[j, 2]) - torch.max(b[i, 0], b[j, 0])).clamp(min=0)
            h = (torch.min(b[i, 3], b[j, 3]) - torch.max(b[i, 1], b[j, 1])).clamp(min=0)
            inter = w * h
            if inter / (area[i] + area[j] - inter) > iou:
                ok = False
                break
        if ok:
            keep.append(i)
    return keep


def test_imports_with_its_operators():
    assert torchvision.extension._has_ops()
    assert torch.ops.torchvision._cuda_version() == -1
    for name in ("nms", "roi_align", "deform_conv2d", "ps_roi_pool"):
        assert hasattr(torch.ops.torchvision, name), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("iou", [0.3, 0.7])
def test_nms_equals_greedy_reference(dtype, iou):
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=gen) * 20
    wh = torch.rand(60, 2, generator=gen) * 20 + 5
    boxes = torch.cat([xy, xy + wh], dim=1).to(dtype)
    scores = torch.randperm(60, generator=gen).to(dtype) / 60  # distinct
    got = torchvision.ops.nms(boxes, scores, iou)
    assert got.dtype == torch.int64
    assert got.tolist() == _greedy_nms(boxes, scores, iou)
    assert 1 < len(got) < 60  # some boxes suppressed, some kept


def test_transforms_run():
    from torchvision.transforms.v2 import functional as F

    image = torch.rand(3, 50, 60)
    assert F.resize(image, [28, 28]).shape == (3, 28, 28)


def test_detection_ops_have_no_cpu_kernel():
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.torchvision.roi_align(
            torch.rand(1, 1, 8, 8),
            torch.tensor([[0, 0, 0, 4, 4.0]]),
            1.0,
            2,
            2,
            1,
            False,
        )
