"""``vllm-br check``: the options, the context the checks run in, and the
output (progress lines and a summary, or ``--json``); exit status 0 when
no check failed, 1 otherwise."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from vllm_br.errors import SUPAConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_br.check.runner import GROUPS

    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as a JSON list instead (everything else goes to stderr)",
    )
    parser.add_argument(
        "--only",
        metavar="GROUP[,GROUP]",
        help=f"run only these groups: {', '.join(GROUPS)}",
    )
    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="processes (one per device) for the collectives; default: every "
        "visible card, 2 on a host-emulated backend",
    )


def select_groups(only: str | None) -> tuple[str, ...]:
    from vllm_br.check.runner import GROUPS

    if not only:
        return GROUPS
    chosen = [g.strip() for g in only.split(",") if g.strip()]
    unknown = [g for g in chosen if g not in GROUPS]
    if unknown or not chosen:
        raise SUPAConfigError(
            f"vllm-br check --only {only!r} names no known group; choose from "
            f"{', '.join(GROUPS)} (comma-separated)."
        )
    return tuple(g for g in GROUPS if g in chosen)


def default_devices(backend) -> int:
    """Every visible card (the owner's run is the chance to exercise every
    link); 2 where devices are emulated on the host, since every emulated
    device is the same CPU and each process imports torch and vLLM again."""
    count = backend.device_count()
    return min(count, 2) if backend.host_memory_is_device_memory else count


def _devices(requested: int | None, backend) -> int:
    count = backend.device_count()
    if requested is None:
        return default_devices(backend)
    if not 1 <= requested <= count:
        raise SUPAConfigError(
            f"vllm-br check --devices {requested} is not between 1 and the "
            f"{count} visible devices; pass a number in that range "
            "(SUPA_VISIBLE_DEVICES, or VLLM_BR_CPU_NUM_DEVICES on the cpu "
            "backend, sets how many are visible)."
        )
    return requested


def _quiet_vllm() -> None:
    # vLLM logs to stdout at INFO; the checks' lines are the output here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def run(args: argparse.Namespace) -> int:
    groups = select_groups(args.only)
    _quiet_vllm()
    if not args.json:
        return _run(args, groups, sys.stdout)
    # Anything else written to stdout (C++ code, child processes, vLLM) goes
    # to stderr; the JSON alone goes to the real stdout at the end.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(os.dup(saved), "w")
    try:
        return _run(args, groups, out)
    finally:
        sys.stdout.flush()
        out.close()
        os.dup2(saved, 1)
        os.close(saved)


def _run(args: argparse.Namespace, groups: Sequence[str], out) -> int:
    from vllm_br.check import report
    from vllm_br.check.base import CheckContext
    from vllm_br.check.runner import run_checks
    from vllm_br.device import get_backend

    backend = get_backend()
    devices = _devices(args.devices, backend)
    index = backend.current_device()
    backend.set_device(index)
    ctx = CheckContext(
        backend=backend, device=backend.torch_device(index), devices=devices
    )
    if not args.json:
        name = backend.get_device_properties(index).name
        print(
            f"vllm-br check: {backend.name} backend, device {index} ({name}), "
            f"groups {', '.join(groups)}",
            flush=True,
        )

    def progress(result) -> None:
        if not args.json:
            print(report.progress_line(result), flush=True)

    results = run_checks(ctx, tuple(groups), progress)
    if args.json:
        out.write(report.to_json(results) + "\n")
    else:
        print("\n" + report.summary(results), flush=True)
    failed = any(r.passed is False for r in results)
    return 1 if failed or not results else 0
