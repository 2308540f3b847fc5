"""One line instead of one warning per weight when float32 weights are
served in a narrower model dtype.

The default model folder stores float32 weights (exact for its GGUF) and
its config asks for bfloat16, as do many checkpoints saved from float32
training. vLLM then warns once per weight (122 lines for SmolLM2), a
warning the user can act on only by choosing the dtype, which is what the
summary line says.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vllm_br import compat

_NARROWER = (torch.bfloat16, torch.float16)


class NarrowingCasts(logging.Filter):
    """Drops vLLM's per-weight float32 -> bfloat16/float16 warnings and counts
    them by (stored, served) dtype; every other record passes."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            record.msg == compat.WEIGHT_DTYPE_WARNING
            and isinstance(args, tuple)
            and len(args) == 3
            and args[1] == torch.float32
            and args[2] in _NARROWER
        ):
            self.casts[(args[1], args[2])] += 1
            return False
        return True


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def summarized_weight_casts(logger: logging.Logger) -> Iterator[NarrowingCasts]:
    """While loading weights, count vLLM's narrowing-cast warnings instead of
    printing them; then log one line per (stored, served) pair."""
    casts = NarrowingCasts()
    vllm_logger = logging.getLogger(compat.WEIGHT_DTYPE_WARNING_LOGGER)
    vllm_logger.addFilter(casts)
    try:
        yield casts
    finally:
        vllm_logger.removeFilter(casts)
    for (stored, served), count in casts.casts.items():
        logger.info(
            "%d weights stored in %s are served in %s, the model's dtype; "
            "pass --dtype %s to serve them as stored.",
            count,
            _name(stored),
            _name(served),
            _name(stored),
        )
