"""`vllm-br` command: what the plugin sees on this machine.

vllm-br info          platform, backend, versions, devices, topology, settings
vllm-br info --json   the same as JSON
vllm-br check         conformance checks on the active device backend
                      (docs/check.md); --json, --only GROUP[,GROUP], --devices N
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_info() -> dict[str, Any]:
    from vllm_br import envs
    from vllm_br._version import SUPPORTED_VLLM_VERSION, __version__
    from vllm_br.errors import SUPAConfigError

    info: dict[str, Any] = {
        "vllm_br": __version__,
        "versions": {
            "torch": _version("torch"),
            "vllm": _version("vllm"),
            "vllm_supported": SUPPORTED_VLLM_VERSION,
        },
    }
    settings: dict[str, Any] = {}
    for name in envs.names():
        try:
            settings[name] = getattr(envs, name)
        except SUPAConfigError as e:
            settings[name] = f"INVALID: {e}"
    info["settings"] = settings

    from vllm.platforms import current_platform

    info["platform"] = (
        f"{type(current_platform).__module__}.{type(current_platform).__name__}"
    )
    try:
        from vllm_br.device import get_backend

        backend = get_backend()
    except SUPAConfigError as e:
        info["error"] = str(e)
        return info
    info["device_backend"] = backend.name
    info["versions"].update(backend.versions())
    devices = []
    for i in range(backend.device_count()):
        props = backend.get_device_properties(i)
        free, total = (
            backend.mem_get_info(i)
            if i == backend.current_device()
            else (None, props.total_memory)
        )
        devices.append(
            {
                "index": i,
                "name": props.name,
                "total_memory_bytes": total,
                "free_memory_bytes": free,
                "spc_count": props.spc_count,
                "numa_node": props.numa_node,
            }
        )
    info["devices"] = devices
    topo = backend.topology()
    info["topology"] = {
        "p2p": topo.p2p,
        "numa_nodes": topo.numa_nodes,
        "spc_counts": topo.spc_counts,
        "dies_per_device": topo.dies_per_device,
    }
    return info


def _print_text(info: dict[str, Any]) -> None:
    gib = 1 << 30
    print(f"vllm-br {info['vllm_br']}")
    print(f"platform:        {info['platform']}")
    print(f"device backend:  {info.get('device_backend', '-')}")
    for k, v in info["versions"].items():
        print(f"{k + ':':<17}{v if v is not None else 'not installed'}")
    if "error" in info:
        print(f"error:           {info['error']}")
    for d in info.get("devices", []):
        free = (
            ""
            if d["free_memory_bytes"] is None
            else f", {d['free_memory_bytes'] / gib:.1f} GiB free"
        )
        print(
            f"supa:{d['index']}  {d['name']}  {d['total_memory_bytes'] / gib:.1f} GiB{free}, "
            f"{d['spc_count']} SPCs, NUMA node {d['numa_node']}"
        )
    topo = info.get("topology")
    if topo:
        n = len(topo["p2p"])
        print("P2P matrix:")
        print("      " + " ".join(f"{j:>3}" for j in range(n)))
        for i, row in enumerate(topo["p2p"]):
            print(f"  {i:>3} " + " ".join("  Y" if x else "  ." for x in row))
    print("settings:")
    for k, v in info["settings"].items():
        print(f"  {k}={v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-br", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="platform, devices, topology and settings")
    p_info.add_argument("--json", action="store_true", help="print JSON")
    p_check = sub.add_parser(
        "check",
        help="conformance checks: ops, attention, graphs, memory, collectives, "
        "end to end (exit 0 when none fails)",
    )
    from vllm_br.check import command as check_command

    check_command.add_arguments(p_check)
    args = parser.parse_args(argv)
    if args.command == "info":
        info = collect_info()
        if args.json:
            print(json.dumps(info, indent=2, default=str))
        else:
            _print_text(info)
        return 0 if "error" not in info else 1
    if args.command == "check":
        from vllm_br.errors import SUPAConfigError

        try:
            return check_command.run(args)
        except SUPAConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
