"""How results are shown: a progress line per check as it finishes, the
summary table at the end, and the ``--json`` list."""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_br.check.result import FAIL, PASS, SKIP, Result


def _measured(r: Result) -> str:
    o = r.outcome
    if o.shown:
        return o.shown
    if o.error is None:
        return o.metric
    tol = "" if o.tolerance is None else f" (tol {o.tolerance:.3g})"
    return f"{o.metric} {o.error:.3g}{tol}"


def progress_line(r: Result) -> str:
    line = (
        f"{r.status:<4}  {r.group + '/' + r.name:<46} {_measured(r)}  {r.seconds:.2f} s"
    )
    if r.status != PASS and r.outcome.detail:
        line += f"\n      {r.outcome.detail}"
    return line


def summary(results: Sequence[Result]) -> str:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    rows = [("group", "checks", "pass", "fail", "skip", "seconds")]
    for group, rs in groups.items():
        rows.append(
            (
                group,
                str(len(rs)),
                *(str(sum(r.status == s for r in rs)) for s in (PASS, FAIL, SKIP)),
                f"{sum(r.seconds for r in rs):.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed = [r for r in results if r.status == FAIL]
    skipped = [r for r in results if r.status == SKIP]
    for title, rs in (("failed", failed), ("skipped", skipped)):
        if rs:
            lines.append(f"\n{title}:")
            lines += [f"  {r.group}/{r.name}: {r.outcome.detail}" for r in rs]
    verdict = "FAIL" if failed else "PASS"
    lines.append(
        f"\n{verdict}: {len(results)} checks, "
        f"{len(results) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
        f"{len(skipped)} skipped in {sum(r.seconds for r in results):.1f} s"
    )
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> str:
    return json.dumps([r.to_json() for r in results], indent=2)
