"""DeepSeek Sparse Attention on SUPA: ``SUPA_FLASH_MLA_SPARSE`` and the
lightning indexer's backend ``SUPA_SPARSE_INDEXER`` (DeepSeek V3.2).

Each MLA layer of a sparse model has a lightning indexer: it keeps one index
key per token in a cache of its own (a separate KV-cache group, so it has its
own block table), scores every visible cached token for each query token and
writes the ``index_topk`` best request-local positions into the model's
shared top-k buffer. The MLA layer then attends only those positions.

* :class:`SupaSparseIndexerBackend` - the indexer cache's backend: block size
  128, keys in the model's dtype, metadata = slot mapping, block table,
  query starts and sequence lengths.
* ``torch.ops.vllm_br.sparse_attn_indexer`` - the indexer's cache write and
  top-k (ops ``indexer_k_cache_write`` and ``sparse_attn_indexer``) as one
  opaque op that reads the step's metadata from vLLM's forward context; it is
  a graph splitting op (``SUPA_SPARSE_INDEXER_OP``, added by the platform),
  like vLLM's own ``vllm::sparse_attn_indexer``.
* :class:`SupaFlashMLASparseBackend` - MLA over the same latent cache as
  ``SUPA_FLASH_MLA`` (whose cache write it shares); every token, prefill and
  decode, takes the absorbed path restricted to its top-k positions
  (op ``sparse_mla_attention``), as vLLM's XPU sparse backend does.

Both builders support FULL graphs of uniform single-token decode batches: the
ops compute each token's request and visible length from the runner's
persistent buffers (``token_requests``), so a replay re-reads them.

See docs/mla.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_br.attention import (
    SUPA_BLOCK_SIZE,
    SUPA_FLASH_MLA_SPARSE,
    SUPA_SPARSE_INDEXER,
    SUPA_SPARSE_INDEXER_OP,
    register_attention_backends,
)
from vllm_br.ops.registry import get_op

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

_LAYOUTS = (
    KVCacheLayout.LBNHC,
    KVCacheLayout.BLNHC,
    KVCacheLayout.LBHNC,
    KVCacheLayout.BLHNC,
)


def token_requests(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its request, and how many of the request's tokens it sees
    (its context and itself). Computed on the device from the runner's query
    starts and sequence lengths (under async scheduling the host's may be
    ahead), inside the ops: a captured graph re-reads those buffers at every
    replay. Padding requests (sequence length 0) see nothing."""
    num_reqs = seq_lens.shape[0]
    qsl = query_start_loc[: num_reqs + 1].to(torch.long)
    tokens = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tokens, right=True).clamp_(max=num_reqs - 1)
    key_lens = seq_lens.to(torch.long)[req] - (qsl[req + 1] - 1 - tokens)
    return req, key_lens.clamp_(min=0)


def _capture_bound(common: CommonAttentionMetadata, block_size: int) -> int:
    """A captured graph keeps its host values: bound the gathers by the
    block table's full width so every batch of the captured size fits."""
    return common.block_table_tensor.shape[1] * block_size


class _SupaPagedCacheBackend(AttentionBackend):
    """What both sparse backends' caches share: SUPA's 128-token blocks in
    the model's dtype, any head size, the layouts of SUPA_FLASH_ATTN (the
    ops index through strides)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16"]

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> list[int | MultipleOf]:
        return [SUPA_BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return _LAYOUTS


# --------------------------------------------------------------------------- #
# The lightning indexer
# --------------------------------------------------------------------------- #


@dataclass
class SupaSparseIndexerMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_key_len: int
    """Host-side upper bound of the tokens a query sees (sizes the gather)."""


class SupaSparseIndexerMetadataBuilder(
    AttentionMetadataBuilder[SupaSparseIndexerMetadata]
):
    # Decode batches can be captured whole; prefills run eagerly between
    # PIECEWISE pieces (the indexer op splits the graph).
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SupaSparseIndexerMetadata:
        common = common_attn_metadata
        return SupaSparseIndexerMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table_tensor[: common.num_reqs],
            query_start_loc=common.query_start_loc[: common.num_reqs + 1],
            seq_lens=common.seq_lens[: common.num_reqs],
            max_key_len=int(common.max_seq_len),
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> SupaSparseIndexerMetadata:
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        metadata.max_key_len = _capture_bound(
            common_attn_metadata, self.kv_cache_spec.block_size
        )
        return metadata


class SupaSparseIndexerBackend(_SupaPagedCacheBackend):
    """The lightning indexer's key cache: ``[num_blocks, 128, index_head_dim]``
    in the model's dtype (no FP8 on SUPA)."""

    @staticmethod
    def get_name() -> str:
        return SUPA_SPARSE_INDEXER

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("The indexer cache has no attention impl.")

    @staticmethod
    def get_builder_cls() -> type[SupaSparseIndexerMetadataBuilder]:
        return SupaSparseIndexerMetadataBuilder


def _sparse_attn_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    layer_name: str,
    softmax_scale: float,
    topk: int,
) -> None:
    """Write the step's index keys, then each token's top-k positions into
    ``topk_indices_buffer[:T, :topk]`` (``-1`` padded)."""
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict) or layer_name not in attn_metadata:
        return  # profiling / dummy run: no metadata
    metadata = attn_metadata[layer_name]
    assert isinstance(metadata, SupaSparseIndexerMetadata)
    k_cache = get_forward_context().no_compile_layers[layer_name].kv_cache
    num_tokens = metadata.num_actual_tokens
    get_op("indexer_k_cache_write")(k[:num_tokens], k_cache, metadata.slot_mapping)
    token_to_req, key_lens = token_requests(
        metadata.query_start_loc, metadata.seq_lens, num_tokens
    )
    get_op("sparse_attn_indexer")(
        q[:num_tokens],
        weights[:num_tokens],
        k_cache,
        metadata.block_table,
        token_to_req,
        key_lens,
        softmax_scale,
        topk,
        max_key_len=metadata.max_key_len,
        out=topk_indices_buffer,
    )


def _sparse_attn_indexer_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    layer_name: str,
    softmax_scale: float,
    topk: int,
) -> None:
    return None


_NAMESPACE, _OP_NAME = SUPA_SPARSE_INDEXER_OP.split("::")
_LIB = torch.library.Library(_NAMESPACE, "FRAGMENT")
direct_register_custom_op(
    op_name=_OP_NAME,
    op_func=_sparse_attn_indexer,
    mutates_args=["topk_indices_buffer"],
    fake_impl=_sparse_attn_indexer_fake,
    target_lib=_LIB,
    dispatch_key=current_platform.dispatch_key,
)


# --------------------------------------------------------------------------- #
# Sparse MLA
# --------------------------------------------------------------------------- #


@dataclass
class SupaFlashMLASparseMetadata:
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    topk_tokens: int
    # vLLM's MLA layer splits on these: every token is routed to the top-k
    # MQA path (num_decode_tokens == num_actual_tokens).
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int


class SupaFlashMLASparseMetadataBuilder(
    AttentionMetadataBuilder[SupaFlashMLASparseMetadata]
):
    # Decode batches can be captured whole: the op reads the top-k buffer,
    # the block table and the query starts from persistent buffers.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = vllm_config.model_config.hf_text_config.index_topk

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SupaFlashMLASparseMetadata:
        common = common_attn_metadata
        return SupaFlashMLASparseMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            block_table=common.block_table_tensor[: common.num_reqs],
            query_start_loc=common.query_start_loc[: common.num_reqs + 1],
            seq_lens=common.seq_lens[: common.num_reqs],
            topk_tokens=self.topk_tokens,
            num_decodes=common.num_reqs,
            num_prefills=0,
            num_decode_tokens=common.num_actual_tokens,
        )


class SupaFlashMLASparseImpl(MLAAttentionImpl[SupaFlashMLASparseMetadata]):
    is_sparse = True
    supports_dense_mha_prefill = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: object | None = None,
        **mla_args,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                "SUPA_FLASH_MLA_SPARSE does not support ALiBi, sliding window or "
                "logits soft-cap."
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"SUPA_FLASH_MLA_SPARSE does not support attention type {attn_type}."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        # The indexer owns the buffer (a draft's indexer may be repointed
        # after this impl is built), so it is read through it per step.
        self._indexer = indexer
        self._topk_indices_buffer = topk_indices_buffer

    @property
    def topk_indices_buffer(self) -> torch.Tensor | None:
        if self._indexer is not None:
            return self._indexer.topk_indices_buffer  # type: ignore[attr-defined]
        return self._topk_indices_buffer

    def record_logical_topk_ready(self) -> None:
        # vLLM's index groups share converted indices across layers; the SUPA
        # op converts per layer, so there is nothing to record.
        return

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        get_op("concat_and_cache_mla")(
            kv_c_normed, k_pe, kv_cache, slot_mapping.flatten()
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: SupaFlashMLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every token (prefill and decode): ``q`` is ``(q_nope @ W_UK,
        q_pe)``; the result ``[tokens, N, kv_lora_rank]`` is up-projected by
        the layer."""
        buffer = self.topk_indices_buffer
        assert buffer is not None
        num_tokens = attn_metadata.num_actual_tokens
        token_to_req, _ = token_requests(
            attn_metadata.query_start_loc, attn_metadata.seq_lens, num_tokens
        )
        out = get_op("sparse_mla_attention")(
            q,
            kv_c_and_k_pe_cache,
            attn_metadata.block_table,
            token_to_req,
            buffer[:num_tokens, : attn_metadata.topk_tokens],
            self.scale,
            self.kv_lora_rank,
        )
        return out, None


class SupaFlashMLASparseBackend(_SupaPagedCacheBackend):
    """SUPA sparse MLA: the dense backend's latent cache, top-k attention."""

    @staticmethod
    def get_name() -> str:
        return SUPA_FLASH_MLA_SPARSE

    @staticmethod
    def get_impl_cls() -> type[SupaFlashMLASparseImpl]:
        return SupaFlashMLASparseImpl

    @staticmethod
    def get_builder_cls() -> type[SupaFlashMLASparseMetadataBuilder]:
        return SupaFlashMLASparseMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


register_attention_backends()
