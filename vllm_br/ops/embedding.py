"""Token-embedding lookup (vocab-parallel) and logits computation.

``vocab_parallel_embedding`` is what vLLM's ``VocabParallelEmbedding.forward``
does on one tensor-parallel rank before the all-reduce: ids outside this
rank's shard (base vocab ``[org_vocab_start, org_vocab_end)`` plus LoRA-added
vocab ``[added_vocab_start, added_vocab_end)``) read row 0 and are zeroed;
ids inside are shifted to their row in the shard (the added rows follow the
base rows and their padding). Unlike vLLM it is not wrapped in
``torch.compile``: plain eager ops, which every backend runs.

Logits are ``hidden @ lm_head.T (+ bias)``; ``logits_soft_cap_and_scale`` is
the post-gather part of ``LogitsProcessor.forward`` (Gemma 2 soft cap, then
the model's logit scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_br.ops.linear import gemm_in_copy
from vllm_br.ops.registry import register_op


@register_op("embedding")
def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain lookup: the unsharded (tp_size == 1) case."""
    return F.embedding(input_ids.long(), weight)


@register_op("vocab_parallel_embedding")
def vocab_parallel_embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    org_vocab_start: int,
    org_vocab_end: int,
    num_org_vocab_padding: int,
    added_vocab_start: int,
    added_vocab_end: int,
) -> torch.Tensor:
    """This rank's partial embedding: rows for in-shard ids, zeros elsewhere."""
    org_mask = (input_ids >= org_vocab_start) & (input_ids < org_vocab_end)
    added_mask = (input_ids >= added_vocab_start) & (input_ids < added_vocab_end)
    added_offset = (
        added_vocab_start - (org_vocab_end - org_vocab_start) - num_org_vocab_padding
    )
    valid_offset = (org_vocab_start * org_mask) + (added_offset * added_mask)
    vocab_mask = org_mask | added_mask
    masked_ids = vocab_mask * (input_ids - valid_offset)
    out = F.embedding(masked_ids.long(), weight)
    return out.masked_fill_(~vocab_mask.unsqueeze(-1), 0)


@register_op("compute_logits")
def compute_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    matmul_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's vocab shard of the logits (unquantized lm_head).
    ``matmul_weight``: ``weight`` in a wider dtype, multiplied instead (a
    device kernel may choose per call); the logits are rounded to the hidden
    states' dtype, as without it."""
    if matmul_weight is None:
        return F.linear(hidden_states, weight, bias)
    return gemm_in_copy(hidden_states, matmul_weight, bias)


@register_op("logits_soft_cap_and_scale")
def logits_soft_cap_and_scale(
    logits: torch.Tensor, soft_cap: float | None, scale: float
) -> torch.Tensor:
    """``tanh(logits / soft_cap) * soft_cap`` if soft_cap, then ``* scale``."""
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    if scale != 1.0:
        logits = logits * scale
    return logits
