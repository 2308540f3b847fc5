"""Runs the selected groups' checks one by one, timing each; a check that
raises fails with the exception named, and the run goes on."""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Iterator

from vllm_br.check.base import CheckContext, dtype_name
from vllm_br.check.result import Outcome, Result
from vllm_br.errors import SUPAConfigError

#: every group, in the order they run (cheapest first, the engine last)
GROUPS = ("ops", "attention", "graphs", "memory", "collectives", "e2e")

Thunk = Callable[[], Outcome]


def _op_group(group: str) -> Callable[[CheckContext], Iterator[tuple[str, Thunk]]]:
    def checks(ctx: CheckContext) -> Iterator[tuple[str, Thunk]]:
        from vllm_br.check import coverage

        if group == "ops":
            yield "coverage", coverage.coverage_outcome
        for c in coverage.op_checks()[group]:
            for dtype in ctx.dtypes:
                tol = c.tolerances[dtype]
                yield (
                    f"{c.name}[{dtype_name(dtype)}]",
                    lambda c=c, dtype=dtype, tol=tol: c.fn(ctx, dtype, tol),
                )

    return checks


def _module_group(name: str) -> Callable[[CheckContext], Iterator[tuple[str, Thunk]]]:
    def checks(ctx: CheckContext) -> Iterator[tuple[str, Thunk]]:
        yield from importlib.import_module(f"vllm_br.check.{name}").checks(ctx)

    return checks


_CHECKS = {
    "ops": _op_group("ops"),
    "attention": _op_group("attention"),
    "graphs": _module_group("graphs"),
    "memory": _module_group("memory"),
    "collectives": _module_group("collectives"),
    "e2e": _module_group("e2e"),
}


def _failure(e: BaseException) -> Outcome:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    first = (str(e).strip().splitlines() or [""])[0]
    return Outcome(
        passed=False, metric="exception", detail=f"{type(e).__name__}: {first}{where}"
    )


def run_checks(
    ctx: CheckContext,
    groups: tuple[str, ...] = GROUPS,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    results: list[Result] = []

    def record(name: str, group: str, outcome: Outcome, seconds: float) -> None:
        if outcome.seconds is not None:
            seconds = outcome.seconds
        result = Result(name, group, outcome, seconds)
        results.append(result)
        if on_result is not None:
            on_result(result)

    for group in groups:
        it = _CHECKS[group](ctx)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it, None)
            except SUPAConfigError:
                raise
            except Exception as e:  # the group could not set up its checks
                record("setup", group, _failure(e), time.perf_counter() - t0)
                break
            if item is None:
                break
            name, thunk = item
            t0 = time.perf_counter()
            try:
                outcome = thunk()
            except SUPAConfigError:
                raise
            except Exception as e:
                outcome = _failure(e)
            record(name, group, outcome, time.perf_counter() - t0)
    return results
