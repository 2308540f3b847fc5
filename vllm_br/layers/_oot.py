"""Out-of-tree registration with vLLM's CustomOp / PluggableLayer registry.

How vLLM replaces a class (``vllm/model_executor/custom_op.py``): both
``CustomOp.__new__`` and ``PluggableLayer.__new__`` look the class being
instantiated up *by its ``__name__``* in ``op_registry_oot`` and, on a hit,
build the registered class instead (``__init__`` then runs on it, so the OOT
class must be a subclass taking the same arguments). ``register_oot(cls,
name=...)`` fills that dict. Because the lookup is by the exact name, a
subclass (``Llama3RotaryEmbedding`` of ``RotaryEmbedding``,
``QKVParallelLinear`` of ``ColumnParallelLinear``) is *not* replaced by its
parent's registration: each needs its own entry, which is why every class we
serve is listed explicitly.

``register_oot`` also sets ``cls.name`` to the registry key (the class name,
e.g. ``"RMSNorm"``), while ``CompilationConfig.custom_ops`` flags and vLLM's
fusion passes use the in-tree op name (``"+rms_norm"``). We put the in-tree
name back so ``custom_ops=["none", "+rms_norm"]`` / ``"-rms_norm"`` mean the
same for our class as for vLLM's.
"""

from __future__ import annotations

from vllm_br.logger import init_logger

logger = init_logger(__name__)


def register_oot(base: type, oot_cls: type, registry: dict) -> bool:
    """Register ``oot_cls`` to replace ``base``; idempotent. ``registry`` is
    the ``op_registry_oot`` dict that ``base``'s ``register_oot`` writes."""
    key = base.__name__
    existing = registry.get(key)
    if existing is oot_cls:
        return False
    if existing is not None:
        logger.warning(
            "Not registering %s for %s: %s is already registered out of tree.",
            oot_cls.__name__,
            key,
            getattr(existing, "__qualname__", existing),
        )
        return False
    base.register_oot(oot_cls, name=key)
    in_tree_name = getattr(base, "name", None)
    if in_tree_name is not None:
        oot_cls.name = in_tree_name
    logger.debug("Registered %s for vLLM's %s.", oot_cls.__name__, key)
    return True
