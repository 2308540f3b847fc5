"""The plugin's structure, checked from its source: its layers import
downward only, and what differs between device backends is asked of the
backend's capabilities, never of its name, outside ``vllm_br/device/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_br"


# The layers, bottom up: a module may import its own layer and those below.
# device <- ops <- layers/attention <- worker <- platform, with the
# foundation (settings, errors, logging, the vLLM compat module) under all.
LAYERS: dict[str, int] = {
    **dict.fromkeys(
        ["_version", "errors", "envs", "logger", "compat", "model_cache", "hf_config"],
        0,
    ),
    "device": 1,
    "ops": 2,
    **dict.fromkeys(
        [
            "layers",
            "attention",
            "quantization",
            "distributed",
            "models",
            "compilation",
            "executor",
            "spec_decode",
        ],
        3,
    ),
    "worker": 4,
    "patches": 5,
    **dict.fromkeys(["entry_points", "check"], 6),
    **dict.fromkeys(["platform", "cli"], 7),
    "__init__": 8,
}


def _unit(path: Path) -> str:
    """The top-level unit of vllm_br a source file belongs to."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _runtime_imports(source: str) -> list[tuple[int, str]]:
    """(line, vllm_br unit) of every import that runs (not those under
    ``if TYPE_CHECKING:``, which only annotate)."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
            "TYPE_CHECKING"
        ):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "vllm_br":  # a submodule, or the package itself
                names = [
                    f"vllm_br.{a.name}"
                    if (PACKAGE / a.name).is_dir()
                    or (PACKAGE / f"{a.name}.py").exists()
                    else "vllm_br.__init__"
                    for a in node.names
                ]
        else:
            continue
        found += [
            (node.lineno, n.split(".")[1]) for n in names if n.startswith("vllm_br.")
        ]
    return found


def upward_imports(path: Path, source: str) -> list[str]:
    unit = _unit(path)
    rank = LAYERS[unit]
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports vllm_br.{target}"
        for line, target in _runtime_imports(source)
        if target != unit
        and LAYERS.get(target, 99) >= rank
        and not (LAYERS.get(target) == rank == 0)
    ]


def test_every_unit_has_a_layer():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LAYERS), units - set(LAYERS)


def test_layers_import_downward_only():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offenders += upward_imports(path, path.read_text())
    assert not offenders, "imports against the layer order:\n" + "\n".join(offenders)


def test_the_import_check_sees_an_upward_import():
    device_file = PACKAGE / "device" / "cpu.py"
    assert upward_imports(device_file, "from vllm_br.ops import linear\n")
    assert upward_imports(device_file, "import vllm_br.ops.weight_layout\n")
    assert upward_imports(device_file, "from vllm_br import worker\n")
    assert upward_imports(PACKAGE / "ops" / "linear.py", "import vllm_br.layers\n")
    # downward, its own layer, and type-only imports are fine
    assert not upward_imports(device_file, "from vllm_br import envs\n")
    assert not upward_imports(
        device_file,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from vllm_br.ops.paged_attention import PagedAttentionPlan\n",
    )
    assert not upward_imports(PACKAGE / "platform.py", "from vllm_br import worker\n")


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
    return owner in ("backend", "_BACKEND") or owner.endswith(
        (".backend", "get_backend()")
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
    assert cpu.default_graph_modes == ("VLLM_COMPILE", "NONE")
    assert supa.default_graph_modes == ("VLLM_COMPILE", "FULL_AND_PIECEWISE")
