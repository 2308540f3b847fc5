"""Float64 formulas the references share (plain PyTorch, nothing from
``vllm_br.ops``)."""

from __future__ import annotations

import math

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1.0 + torch.tanh(inner))


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gated activation's input."""
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]
