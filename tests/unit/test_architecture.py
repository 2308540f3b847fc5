"""The plugin's structure, checked from its source: what differs between
device backends is asked of the backend's capabilities, never of its name,
outside ``vllm_br/device/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_br"


def _names_a_backend(node: ast.AST) -> bool:
    """``backend.name``, ``self.backend.name``, ``get_backend().name`` or a
    platform's ``backend_name``."""
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "backend_name":
        return True
    if node.attr != "name":
        return False
    owner = ast.unparse(node.value)
    return (
        owner in ("backend", "_BACKEND")
        or owner.endswith((".backend", "get_backend()"))
    )


def backend_name_comparisons(source: str) -> list[str]:
    """Each comparison of a device backend's name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            _names_a_backend(side) for side in (node.left, *node.comparators)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_backend_name_comparison_outside_device():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "device"):
            continue
        offenders += [
            f"{path.relative_to(PACKAGE.parent)} {hit}"
            for hit in backend_name_comparisons(path.read_text())
        ]
    assert not offenders, (
        "compare a backend capability (vllm_br/device/base.py), not its name:\n"
        + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "source",
    [
        'if backend.name == "cpu": pass',
        'x = self.backend.name != "supa"',
        'if get_backend().name in ("cpu",): pass',
        'if SUPAPlatform.backend_name == "cpu": pass',
    ],
)
def test_the_check_sees_each_form(source):
    assert backend_name_comparisons(source)


def test_the_check_leaves_other_names_alone():
    assert not backend_name_comparisons(
        'if layer.name == "x" or props.name == "BR104": pass\n'
        "label = backend.name\n"
        'if selected_backend.name == "FLASH_ATTN": pass'
    )


def test_backends_differ_by_capabilities():
    from vllm_br.device.cpu import CpuBackend
    from vllm_br.device.supa import SupaBackend

    cpu, supa = CpuBackend, SupaBackend
    assert cpu.host_memory_is_device_memory and not supa.host_memory_is_device_memory
    assert cpu.synchronous_execution and not supa.synchronous_execution
    assert supa.numa_weight_layout and not cpu.numa_weight_layout
    assert supa.uses_sccl and not cpu.uses_sccl
    assert cpu.memory_setting == "VLLM_BR_CPU_MEMORY_GIB"
    assert supa.memory_setting is None
    assert "cpp.dynamic_threads" in CpuBackend().inductor_config()
