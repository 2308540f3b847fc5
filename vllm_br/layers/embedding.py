"""VocabParallelEmbedding and LogitsProcessor on ``vllm_br.ops.embedding``.

Both are ``PluggableLayer``s in vLLM 0.33 (no forward_* dispatch): the OOT
class replaces the whole layer at construction and overrides ``forward``.
Quantized embeddings / lm heads (GGUF and the like) keep vLLM's path; the
unquantized ones run our ops. ``ParallelLMHead`` is not replaced: its
forward raises by design and its weight is consumed by LogitsProcessor.
"""

from __future__ import annotations

import torch
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor import custom_op
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from vllm_br.layers._oot import register_oot
from vllm_br.layers.matmul_weights import MATMUL_WEIGHT
from vllm_br.ops import get_op


class SUPAVocabParallelEmbedding(VocabParallelEmbedding):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if type(self.quant_method) is not UnquantizedEmbeddingMethod:
            return super().forward(input_)
        if self.tp_size == 1:
            return get_op("embedding")(input_, self.weight)
        si = self.shard_indices
        output = get_op("vocab_parallel_embedding")(
            input_,
            self.weight,
            si.org_vocab_start_index,
            si.org_vocab_end_index,
            si.num_org_vocab_padding,
            si.added_vocab_start_index,
            si.added_vocab_end_index,
        )
        if self.reduce_results:
            if self.parallel_group is not None:
                return self.parallel_group.all_reduce(output)
            return tensor_model_parallel_all_reduce(output)
        return output


class SUPALogitsProcessor(LogitsProcessor):
    def forward(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,
        embedding_bias: torch.Tensor | None = None,
        skip_gather: bool = False,
    ) -> torch.Tensor | None:
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(
                hidden_states, lm_head, embedding_bias, skip_gather
            )
        if logits is not None and (self.soft_cap is not None or self.scale != 1.0):
            logits = get_op("logits_soft_cap_and_scale")(
                logits, self.soft_cap, self.scale
            )
        return logits

    def _apply_head(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,
        embedding_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if type(lm_head.quant_method) is UnquantizedEmbeddingMethod and (
            self.head_dtype is None or self.head_dtype == hidden_states.dtype
        ):
            return get_op("compute_logits")(
                hidden_states,
                lm_head.weight,
                embedding_bias,
                getattr(lm_head, MATMUL_WEIGHT, None),
            )
        return super()._apply_head(lm_head, hidden_states, embedding_bias)


OOT_LAYERS: list[tuple[type, type]] = [
    (VocabParallelEmbedding, SUPAVocabParallelEmbedding),
    (LogitsProcessor, SUPALogitsProcessor),
]


def register() -> list[str]:
    return [
        f"{base.__module__}.{base.__name__}"
        for base, cls in OOT_LAYERS
        if register_oot(base, cls, custom_op.op_registry_oot)
    ]
