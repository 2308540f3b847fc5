"""Which registered op each op check exercises, and the ops none does: a new
op in ``vllm_br.ops`` without a check fails ``vllm-br check`` (and its test)
until one is written."""

from __future__ import annotations

from vllm_br.check import attention, mla, moe, ops, quant, sparse_mla
from vllm_br.check.base import OpCheck
from vllm_br.check.result import Outcome
from vllm_br.ops.registry import registered_ops, resolve_all


def op_checks() -> dict[str, list[OpCheck]]:
    """The op checks of each group."""
    return {
        "ops": [*ops.CHECKS, *quant.CHECKS, *moe.CHECKS],
        "attention": [*attention.CHECKS, *mla.CHECKS, *sparse_mla.CHECKS],
    }


def covered_ops() -> set[str]:
    return {op for checks in op_checks().values() for c in checks for op in c.ops}


def missing_ops() -> list[str]:
    """Registered ops that no check exercises (every op module imported,
    every op resolved on this backend, as a worker does)."""
    resolve_all()
    return sorted(set(registered_ops()) - covered_ops())


def coverage_outcome() -> Outcome:
    missing = missing_ops()
    total = len(registered_ops())
    return Outcome(
        passed=not missing,
        error=float(len(missing)),
        tolerance=0.0,
        metric="ops_without_check",
        shown=f"{total - len(missing)} of {total} registered ops have a check",
        detail=(
            f"no check for: {', '.join(missing)} (add one to vllm_br/check/)"
            if missing
            else f"{total} registered ops"
        ),
    )
