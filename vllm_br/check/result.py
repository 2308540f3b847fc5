"""One check's result, as printed and as sent back in ``--json``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Outcome:
    """What a check measured: ``error`` (in the unit ``metric`` names)
    against ``tolerance``, and whether it passed (None: not run, ``detail``
    says why)."""

    passed: bool | None
    error: float | None = None
    tolerance: float | None = None
    metric: str = "max_err"
    detail: str = ""
    #: how the progress line shows the measurement ("" : error vs tolerance)
    shown: str = ""
    #: the check's own time where the runner cannot time it (another process)
    seconds: float | None = None

    @property
    def status(self) -> str:
        return SKIP if self.passed is None else PASS if self.passed else FAIL


@dataclass
class Result:
    name: str
    group: str
    outcome: Outcome
    seconds: float

    @property
    def status(self) -> str:
        return self.outcome.status

    @property
    def passed(self) -> bool | None:
        return self.outcome.passed

    def to_json(self) -> dict[str, Any]:
        o = self.outcome
        return {
            "name": self.name,
            "group": self.group,
            "passed": o.passed,
            "status": o.status,
            "metric": o.metric,
            "error": _json_number(o.error),
            "tolerance": _json_number(o.tolerance),
            "seconds": round(self.seconds, 4),
            "detail": o.detail,
        }


def _json_number(x: float | None) -> float | str | None:
    """JSON has no NaN or infinity: those travel as strings."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)
