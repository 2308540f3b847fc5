"""The private vLLM names the plugin depends on (``compat.VLLM_PRIVATE_NAMES``)
still exist in the installed vLLM, and every private vLLM method or class
attribute a plugin class overrides is listed there."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import vllm_br
from vllm_br import compat
from vllm_br.compat import VLLM_PRIVATE_NAMES


def vllm_has(key: str) -> bool:
    """Whether ``"module:Qualname.attr"`` exists in the installed vLLM: as an
    attribute, a class annotation, or an attribute the owner's own code
    assigns (an instance attribute set in ``__init__``)."""
    module_name, _, path = key.partition(":")
    try:
        owner = importlib.import_module(module_name)
        *parts, attr = path.split(".")
        for part in parts:
            owner = getattr(owner, part)
    except (ImportError, AttributeError):
        return False
    if hasattr(owner, attr):
        return True
    for klass in getattr(owner, "__mro__", ()):
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\.{re.escape(attr)}\s*(:[^=\n]*)?=[^=]", source):
            return True
    return False


@pytest.mark.parametrize("key", sorted(VLLM_PRIVATE_NAMES))
def test_private_vllm_name_exists(key):
    assert vllm_has(key), (
        f"{key} is gone from the installed vLLM: "
        f"{VLLM_PRIVATE_NAMES[key]} needs another way"
    )


@pytest.mark.parametrize(
    "key",
    [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._no_such_method",
        "vllm.v1.worker.gpu_model_runner:NoSuchClass._dummy_run",
        "vllm.no_such_module:Thing._x",
        "vllm.model_executor.layers.attention.mla_attention:MLAAttention._no_such_flag",
    ],
)
def test_a_missing_name_is_reported(key):
    assert not vllm_has(key)


def _plugin_classes():
    for info in pkgutil.walk_packages(vllm_br.__path__, "vllm_br."):
        if info.name.startswith("vllm_br.device."):
            continue  # the device layer subclasses nothing of vLLM's
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


def _defined_in_body(cls) -> set[str]:
    """The names a class's own source defines (methods, class attributes),
    not those vLLM code assigns on it at run time (e.g. a cached pool)."""
    import ast
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _private_overrides():
    """(plugin class, the vLLM class that defines the name, name) for each
    private, non-dunder name a plugin class defines over a vLLM base."""
    for cls in _plugin_classes():
        vllm_bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("vllm.")]
        if not vllm_bases:
            continue
        for name in _defined_in_body(cls):
            if not name.startswith("_") or name.startswith("__"):
                continue
            for base in vllm_bases:
                if name in vars(base) or name in getattr(base, "__annotations__", {}):
                    yield cls, base, name
                    break


def test_private_overrides_are_listed():
    found = list(_private_overrides())
    listed = set(VLLM_PRIVATE_NAMES)
    missing = [
        f"{cls.__name__}.{name} overrides {base.__module__}:{base.__qualname__}.{name}"
        for cls, base, name in found
        if f"{base.__module__}:{base.__qualname__}.{name}" not in listed
    ]
    assert not missing, "add to vllm_br.compat.VLLM_PRIVATE_NAMES:\n" + "\n".join(
        missing
    )
    # The scan sees the runner's overrides (so an empty scan cannot pass).
    assert {(c.__name__, n) for c, _, n in found} >= {
        ("SUPAModelRunner", "_sync_device"),
        ("SUPAWorker", "_make_model_runner"),
    }


def test_vllm_still_logs_the_weight_dtype_warning_the_worker_summarizes():
    """worker/weight_casts.py matches vLLM's per-weight warning by its exact
    format string, logged by the module named in compat."""
    import ast

    module = importlib.import_module(compat.WEIGHT_DTYPE_WARNING_LOGGER)
    strings = {
        node.value
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert compat.WEIGHT_DTYPE_WARNING in strings


def test_torch_reduce_op_warning_is_torchs_own():
    """The one torch warning the kernel-override registration silences is
    still the one torch raises when reduce_op is touched."""
    import re
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hasattr(dist.reduce_op, "__dict__")
    assert caught, "torch no longer warns on reduce_op: drop the filter"
    assert all(
        re.search(compat.TORCH_REDUCE_OP_WARNING, str(w.message)) for w in caught
    )
