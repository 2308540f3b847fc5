"""``SUPA_FLASH_ATTN``: the SUPA paged-attention backend for vLLM 0.33.

Pieces:

* :class:`SUPAFlashAttentionBackend` - what vLLM's selector and KV-cache
  allocator ask about: kernel block size 128, dtypes bf16/fp32, the KV-cache
  layouts the kernels read (``LBNHC`` preferred), supported features.
* :class:`SUPAFlashAttentionMetadataBuilder` - once per step (per KV-cache
  group) turns vLLM's ``CommonAttentionMetadata`` into
  :class:`SUPAFlashAttentionMetadata`, including the host-built decode/prefill
  plan every layer reuses.
* :class:`SUPAFlashAttentionImpl` - per layer: ``do_kv_cache_update`` writes the
  new K/V (``reshape_and_cache``), ``forward`` runs ``paged_attention_decode``
  and ``paged_attention_prefill`` (or
  ``attention_varlen`` for ENCODER_ONLY layers) into ``output``.

The kernels are the ops ``paged_attention_decode``,
``paged_attention_prefill``, ``reshape_and_cache`` and
``attention_varlen`` (references in :mod:`vllm_br.ops.paged_attention`), called
through ``vllm_br.ops.get_op`` so a device backend can bind fused kernels with
the same signatures (importing the ops module registers them); this module
imports no vendor package.

Per-layer KV cache handed to ``forward``/``do_kv_cache_update``: vLLM's logical
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view (K then V in the
last dim) whose strides follow the resolved layout; with the preferred
``LBNHC`` the memory is ``[num_blocks, block_size, num_kv_heads, 2*head_size]``,
i.e. ``kv_cache.transpose(1, 2)`` is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheLayout,
)

from vllm_br.attention import (
    SUPA_BLOCK_SIZE,
    SUPA_FLASH_ATTN,
    register_attention_backends,
)
from vllm_br.logger import init_logger
from vllm_br.ops.paged_attention import (
    PagedAttentionPlan,
    make_paged_attention_plan,
)
from vllm_br.ops.registry import get_op

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import KVCacheSpec

logger = init_logger(__name__)


class SUPAFlashAttentionBackend(AttentionBackend):
    """SUPA paged attention (decoder, with KV cache; and ENCODER_ONLY)."""

    # The KV cache is written by do_kv_cache_update (unified_kv_cache_update)
    # before forward() reads it.
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return SUPA_FLASH_ATTN

    @staticmethod
    def get_impl_cls() -> type[SUPAFlashAttentionImpl]:
        return SUPAFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SUPAFlashAttentionMetadataBuilder]:
        return SUPAFlashAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> list[int | MultipleOf]:
        return [SUPA_BLOCK_SIZE]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The ops index the 4D layer view through its strides, so every layout
        # is correct; LBNHC (token-major blocks, K|V of all heads contiguous)
        # is the one the SUPA kernel reads densely, hence first.
        return (
            KVCacheLayout.LBNHC,
            KVCacheLayout.BLNHC,
            KVCacheLayout.LBHNC,
            KVCacheLayout.BLHNC,
        )

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # ENCODER_ONLY is how vLLM 0.33 serves BERT/RoBERTa-style pooling
        # models, and it reaches this backend without any other hook:
        # EncoderOnlyAttention asks the platform's selector for a backend with
        # attn_type=ENCODER_ONLY (SUPAPlatform answers SUPA_FLASH_ATTN for every
        # non-MLA layer) and wraps it in create_encoder_only_attention_backend,
        # a subclass "EncoderOnlyAttention_SUPAFlashAttentionBackend" whose
        # builder sets causal=False before calling ours. The layers report no
        # KV-cache spec; the runner puts them in one EncoderOnlyAttentionSpec
        # group of their own (may_add_encoder_only_layers_to_kv_cache_config)
        # with a zero block table and slot mapping. So the builder plans from
        # query_start_loc alone, do_kv_cache_update writes nothing, and
        # forward runs the non-causal attention_varlen op: an encoder's
        # sequence is the whole of its query, there is nothing to page.
        # ENCODER (multimodal towers) and ENCODER_DECODER (cross-attention)
        # are not served.
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The decode/prefill split and query padding are planned from the host
        # query_start_loc, so adaptive verification (device-side trimming of
        # query lengths) is not supported.
        return False


@dataclass
class SUPAFlashAttentionMetadata(AttentionMetadata):
    """Per-step attention metadata shared by every layer of one KV-cache group."""

    num_actual_tokens: int
    """Tokens in the (possibly padded) batch; rows past query_start_loc[-1]
    are padding and are never written."""
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: PagedAttentionPlan
    """Host-built decode/prefill split and padding indices (see ops)."""
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    causal: bool | torch.Tensor = True
    is_encoder_only: bool = False


class SUPAFlashAttentionMetadataBuilder(
    AttentionMetadataBuilder[SUPAFlashAttentionMetadata]
):
    # Uniform single-token decode batches can be captured whole: their plan is
    # the same for every batch of a padded size once its gather width is the
    # block table's (build_for_cudagraph_capture). Mixed batches cannot: their
    # host-built prefill plan depends on each batch's query lengths, so vLLM
    # runs attention eagerly between PIECEWISE pieces for them.
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
        # Decodes (query_len 1) first; the ops then use contiguous slices.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        self.is_encoder_only = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)

    @classmethod
    def get_cudagraph_support(
        cls,
        vllm_config: VllmConfig,
        kv_cache_spec: KVCacheSpec,
    ) -> AttentionCGSupport:
        return cls._cudagraph_support

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> SUPAFlashAttentionMetadata:
        """Metadata a FULL graph keeps for every replay of its batch size.

        A replay re-reads the device tensors (query_start_loc, seq_lens,
        block table, slot mapping are views of the runner's persistent
        buffers) but keeps every host-side value, so the plan must hold for
        any decode batch of this size: gather the whole block table, and
        build masks from seq_lens on each replay instead of sharing them."""
        cm = common_attn_metadata
        if self.is_encoder_only:
            # vLLM gives pooling models no FULL graphs (it turns them into
            # PIECEWISE, where attention runs eagerly), so this is not reached
            # today; if it were, an encoder batch has no cache to gather and
            # its plan (every request's length is its query length) is the
            # same for every batch of this shape.
            return self.build(0, cm)
        width = cm.block_table_tensor.shape[1] * self.kv_cache_spec.block_size
        plan = make_paged_attention_plan(
            cm.query_start_loc_cpu,
            None,
            max_seq_len=max(width, 1),
            device=cm.query_start_loc.device,
            split_decodes=True,
        )
        plan.cache_masks = False
        return self._metadata(cm, plan, max_seq_len=width)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> SUPAFlashAttentionMetadata:
        cm = common_attn_metadata
        qsl_cpu = cm.query_start_loc_cpu
        if self.is_encoder_only:
            # Encoder sequences are their queries: no cache, no decodes.
            seq_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
        elif cm.seq_lens_cpu_upper_bound is not None:
            seq_cpu = cm.seq_lens_cpu_upper_bound
        else:
            seq_cpu = cm.seq_lens.cpu()
        plan = make_paged_attention_plan(
            qsl_cpu,
            seq_cpu,
            max_seq_len=None if self.is_encoder_only else max(cm.max_seq_len, 1),
            device=cm.query_start_loc.device,
            split_decodes=not self.is_encoder_only,
        )
        return self._metadata(cm, plan, max_seq_len=cm.max_seq_len)

    def _metadata(
        self, cm: CommonAttentionMetadata, plan: PagedAttentionPlan, max_seq_len: int
    ) -> SUPAFlashAttentionMetadata:
        return SUPAFlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            plan=plan,
            num_decodes=plan.num_decodes,
            num_decode_tokens=plan.num_decodes,
            num_prefills=plan.num_prefills,
            num_prefill_tokens=plan.num_prefill_tokens,
            causal=cm.causal,
            is_encoder_only=self.is_encoder_only,
        )


class SUPAFlashAttentionImpl(AttentionImpl[SUPAFlashAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("SUPA_FLASH_ATTN does not support ALiBi.")
        if sinks is not None:
            raise NotImplementedError(
                "SUPA_FLASH_ATTN does not support attention sinks."
            )
        if kv_cache_dtype not in ("auto", "bfloat16"):
            raise NotImplementedError(
                f"SUPA_FLASH_ATTN does not support kv_cache_dtype={kv_cache_dtype!r}."
            )
        if attn_type not in (AttentionType.DECODER, AttentionType.ENCODER_ONLY):
            raise NotImplementedError(
                f"SUPA_FLASH_ATTN does not serve {attn_type} attention; serve a "
                "decoder-only model or an encoder-only (BERT/RoBERTa-style) "
                "pooling model."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        assert self.num_heads % self.num_kv_heads == 0
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.sliding_window = (
            None if sliding_window is None or sliding_window <= 0 else sliding_window
        )
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = None
        self.sinks = None

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SUPAFlashAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, num_heads, head_size]``, key/value ``[T, num_kv_heads,
        head_size]``, kv_cache the layer view (see module doc), output
        ``[T, num_heads, head_size]`` (or ``[T, num_heads * head_size]``).
        Writes the real token rows of ``output`` and returns it."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by SUPA_FLASH_ATTN"
            )
        if attn_metadata is None:
            # Profiling run.
            return output

        n = attn_metadata.num_actual_tokens
        if self.attn_type == AttentionType.ENCODER_ONLY:
            get_op("attention_varlen")(
                query[:n],
                key[:n],
                value[:n],
                attn_metadata.query_start_loc,
                self.scale,
                causal=False,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                output=output[:n],
                plan=attn_metadata.plan,
            )
            return output

        # Decodes and prefills are separate kernels (as in vLLM's CPU
        # attention backend); the step's plan says which requests are which.
        plan = attn_metadata.plan
        for op, present in (
            ("paged_attention_decode", plan.num_decodes),
            ("paged_attention_prefill", plan.num_prefills),
        ):
            if present:
                get_op(op)(
                    query[:n],
                    kv_cache,
                    attn_metadata.block_table,
                    attn_metadata.seq_lens,
                    self.scale,
                    self.num_kv_heads,
                    causal=attn_metadata.causal,
                    sliding_window=self.sliding_window,
                    logits_soft_cap=self.logits_soft_cap,
                    output=output[:n],
                    plan=plan,
                )
        return output

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return
        if kv_cache.numel() == 0:
            return
        # key/value may carry padding rows; slot_mapping holds the real tokens
        # (and -1 for padded slots), reshape_and_cache handles both.
        get_op("reshape_and_cache")(key, value, kv_cache, slot_mapping)


# Importing the backend (e.g. through the class path the platform returns)
# makes its name resolvable even if the general plugin has not run yet.
register_attention_backends()
