"""Greedy sampling: the token of highest logit per row.

The reference is vLLM's own formula (``Sampler.greedy_sample`` on every
platform but its CPU one). ``SUPAModelRunner`` points its sampler's greedy
step at this op, so a device backend can bind a faster kernel with the same
result: the index of the first maximal value of each row.
"""

from __future__ import annotations

import torch

from vllm_br.ops.registry import register_op


@register_op("greedy_sample")
def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """``[num_reqs, vocab]`` logits -> ``[num_reqs]`` int64 token ids."""
    return logits.argmax(dim=-1).view(-1)
