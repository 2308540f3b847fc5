"""Comparisons of one check, summarised into its :class:`Outcome`.

The numeric error of ``got`` against a float64 reference ``ref`` is, over
all elements, ``max |got - ref| / max(1, |ref|)``: the absolute error where
values are at most 1 in magnitude, the relative error above. Equal
infinities (an empty row's ``-inf`` log-sum-exp) count as no error; NaN, or
an infinity where the reference has none, as an infinite one. Exact
comparisons (copies, indices) must match bit for bit whatever the tolerance.
"""

from __future__ import annotations

import math

import torch

from vllm_br.check.result import Outcome


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max(1, |ref|)`` in float64 (0 for empty tensors)."""
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if g.numel() == 0:
        return 0.0
    diff = (g - r).abs() / r.abs().clamp(min=1.0)
    diff = torch.where(g == r, torch.zeros_like(diff), diff)
    return float(torch.nan_to_num(diff, nan=math.inf).max())


class Measure:
    """Collects the comparisons of one check against one tolerance."""

    def __init__(self, tolerance: float, metric: str = "max_err") -> None:
        self.tolerance = tolerance
        self.metric = metric
        # (label, error, the tolerance that applies to it)
        self.items: list[tuple[str, float, float]] = []
        self.failures: list[str] = []
        self.notes: list[str] = []

    def close(self, label: str, got: torch.Tensor, ref: torch.Tensor) -> float:
        """``got`` within the tolerance of the float64 reference ``ref``."""
        if tuple(got.shape) != tuple(ref.shape):
            self.failures.append(
                f"{label}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )
            return math.inf
        err = max_error(got, ref)
        self.items.append((label, err, self.tolerance))
        return err

    def exact(self, label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        """``got`` equal to ``ref`` bit for bit (same shape and dtype)."""
        got = got.detach().cpu()
        ref = ref.detach().cpu()
        if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
            self.failures.append(
                f"{label}: {got.dtype} {tuple(got.shape)}, expected "
                f"{ref.dtype} {tuple(ref.shape)}"
            )
            return
        if torch.equal(got, ref):
            self.items.append((label, 0.0, 0.0))
            return
        if got.is_floating_point():
            diff = torch.nan_to_num((got.double() - ref.double()).abs(), nan=math.inf)
            err = float(diff.max())
        else:
            err = float((got != ref).sum())  # how many differ
        self.items.append((label, err, 0.0))

    def require(self, label: str, condition: bool, why: str) -> None:
        """A condition that must hold; ``why`` says what was seen instead."""
        if not condition:
            self.failures.append(f"{label}: {why}")

    def note(self, text: str) -> None:
        self.notes.append(text)

    def outcome(self) -> Outcome:
        over = [(lbl, e, t) for lbl, e, t in self.items if not e <= t]
        worst = max(self.items, key=_ratio, default=None)
        error, tol = (worst[1], worst[2]) if worst else (None, self.tolerance)
        parts = list(self.notes)
        if over:
            parts.append(
                "over tolerance: "
                + "; ".join(f"{lbl} {_fmt(e)} > {_fmt(t)}" for lbl, e, t in over)
            )
        elif worst is not None:
            parts.append(f"worst: {worst[0]}")
        parts += self.failures
        return Outcome(
            passed=not over and not self.failures,
            error=error,
            tolerance=tol,
            metric=self.metric,
            detail="; ".join(parts),
        )


def _ratio(item: tuple[str, float, float]) -> float:
    _, err, tol = item
    if tol > 0:
        return err / tol
    return 0.0 if err == 0 else math.inf


def _fmt(x: float) -> str:
    return f"{x:.3g}"
