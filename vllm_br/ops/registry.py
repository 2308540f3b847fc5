"""The op registry: one reference implementation per op, or the device's kernel.

``@register_op("rms_norm")`` records the plain-PyTorch reference. ``get_op``
returns the kernel that ``get_backend().fused_kernels()`` binds under that
name (same signature and semantics as the reference), else the reference;
it is resolved on first use and cached, so a hot path pays one dict lookup.

A kernel may decline a call it does not handle (a dtype, a head size, a
layout) by returning ``NotImplemented``, having written nothing; the
reference then runs. So kernels never call the references themselves, and
the device layer imports nothing from ``vllm_br.ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_br.logger import init_logger

logger = init_logger(__name__)

_REFERENCE: dict[str, Callable[..., Any]] = {}
_RESOLVED: dict[str, Callable[..., Any]] = {}


def register_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if _REFERENCE.get(name, fn) is not fn:
            raise ValueError(f"op {name!r} is already registered")
        _REFERENCE[name] = fn
        return fn

    return decorator


def reference_op(name: str) -> Callable[..., Any]:
    return _REFERENCE[name]


def _import_op_modules() -> None:
    """Import every module of ``vllm_br.ops`` so all references are known."""
    import importlib
    import pkgutil

    import vllm_br.ops as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def with_fallback(
    kernel: Callable[..., Any], reference: Callable[..., Any]
) -> Callable[..., Any]:
    """``kernel``, and ``reference`` for the calls it declines (returns
    ``NotImplemented``). The kernel is ``.kernel`` of the result."""

    def op(*args: Any, **kwargs: Any) -> Any:
        out = kernel(*args, **kwargs)
        if out is NotImplemented:
            return reference(*args, **kwargs)
        return out

    op.kernel = kernel  # type: ignore[attr-defined]
    op.reference = reference  # type: ignore[attr-defined]
    op.__name__ = getattr(kernel, "__name__", "kernel")
    op.__doc__ = getattr(kernel, "__doc__", None)
    return op


def get_op(name: str) -> Callable[..., Any]:
    fn = _RESOLVED.get(name)
    if fn is None:
        from vllm_br.device import get_backend

        if name not in _REFERENCE:
            _import_op_modules()
        reference = _REFERENCE[name]
        kernel = get_backend().fused_kernels().get(name)
        fn = _RESOLVED[name] = (
            reference if kernel is None else with_fallback(kernel, reference)
        )
        logger.debug("op %s -> %s", name, "kernel" if kernel else "reference")
    return fn


def resolve_all() -> None:
    """Resolve every op now: torch.compile traces ``get_op`` calls, and a
    first-use resolution (imports, logging) inside a traced forward would
    break the graph. The worker calls this before the model first runs."""
    _import_op_modules()
    for name in list(_REFERENCE):
        get_op(name)


def registered_ops() -> list[str]:
    return sorted(_REFERENCE)


def clear_cache() -> None:
    """Forget resolved ops (tests, or after the backend changes)."""
    _RESOLVED.clear()
