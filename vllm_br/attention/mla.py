"""``SUPA_FLASH_MLA``: multi-head latent attention (DeepSeek V2/V3) on SUPA.

Built on vLLM 0.33's MLA common classes
(``vllm/model_executor/layers/attention/mla_attention.py``): vLLM's
``MLAAttention`` layer projects, splits the batch into decodes and prefills
and runs ``forward_mqa`` (decodes) and ``forward_mha`` (prefills) of the
backend's impl; its metadata builder plans the prefills' context chunks. The
classes here override only what touches a kernel:

* :class:`SupaFlashMLABackend` - block size 128, bf16/fp32, any latent size
  (vLLM's own MLA backends list the sizes of their CUDA kernels).
* :class:`SupaFlashMLAMetadataBuilder` - vLLM's builder, plus the host-side
  decode length bound the decode op sizes its gather with (and, for a FULL
  graph, the block table's width).
* :class:`SupaFlashMLAImpl` - ``do_kv_cache_update`` writes the latent
  (``concat_and_cache_mla``); ``forward_mqa`` is the absorbed decode
  (``mla_decode`` over the paged latent cache); ``forward_mha`` is vLLM's
  prefill with the context gather and the LSE merge through the plugin's ops
  (vLLM's call compiled ``_C`` / Triton kernels here). A quantized
  ``kv_b_proj`` is up-projected with its dequantized weight, as the absorbed
  decode uses it (see :meth:`SupaFlashMLAImpl.process_weights_after_loading`).
* :class:`SupaMLAPrefillBackend` - the platform's MLA prefill backend
  (``SUPAPlatform.get_mla_prefill_backend_cls``): ragged causal attention of
  the new tokens and non-causal attention of a context chunk, both with LSE
  (``mla_prefill_attention``).

Latent cache: per layer ``[num_blocks, 128, kv_lora_rank + qk_rope_head_dim]``
(vLLM's ``[B, 1, N, C]`` view, head dim squeezed by ``MLAAttention``): one
entry ``[kv_c | k_pe]`` per token. See docs/mla.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    MLACommonPrefillMetadata,
    QueryLenSupport,
)
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    get_and_maybe_dequant_weights,
)
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_br.attention import (
    SUPA_BLOCK_SIZE,
    SUPA_FLASH_MLA,
    register_attention_backends,
)
from vllm_br.ops.mla import RaggedAttentionPlan, make_ragged_attention_plan
from vllm_br.ops.registry import get_op

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec


class SupaFlashMLABackend(MLACommonBackend):
    """SUPA MLA: latent cache, absorbed decode, up-projected prefill."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return SUPA_FLASH_MLA

    @staticmethod
    def get_impl_cls() -> type[SupaFlashMLAImpl]:
        return SupaFlashMLAImpl

    @staticmethod
    def get_builder_cls() -> type[SupaFlashMLAMetadataBuilder]:
        return SupaFlashMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(
        kv_cache_spec: KVCacheSpec | None = None,
    ) -> list[int | MultipleOf]:
        return [SUPA_BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The reference ops take any kv_lora_rank + rope size.
        return []

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # One latent "head": H = 1, so LBNHC and LBHNC are the same memory;
        # the ops index through strides, so block-outermost layouts work too.
        # Same order as SUPA_FLASH_ATTN, so a mixed model agrees on LBNHC.
        return (
            KVCacheLayout.LBNHC,
            KVCacheLayout.BLNHC,
            KVCacheLayout.LBHNC,
            KVCacheLayout.BLHNC,
        )

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # Prefill plans are built from the host query lengths.
        return False


@dataclass
class SupaFlashMLADecodeMetadata(MLACommonDecodeMetadata):
    max_seq_len: int = 0
    """Host-side upper bound of the decodes' ``seq_lens`` (sizes the gather)."""


@dataclass
class SupaFlashMLAMetadata(MLACommonMetadata[SupaFlashMLADecodeMetadata]):
    def __post_init__(self) -> None:
        # vLLM checks head_dim against its CUDA MLA kernels' sizes
        # (320/512/576); the SUPA ops take any latent size.
        return


class SupaFlashMLAMetadataBuilder(MLACommonMetadataBuilder[SupaFlashMLAMetadata]):
    # Decode batches can be captured whole (build_for_cudagraph_capture);
    # prefills run eagerly between PIECEWISE pieces.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    # Speculative decoding verifies 1 + k tokens per request: those batches
    # go through the decode path, whose seq_lens are the device's. The
    # prefill path's context lengths come from the host, which under async
    # scheduling counts drafts that may since have been rejected.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(
            kv_cache_spec,
            layer_names,
            vllm_config,
            device,
            metadata_cls=SupaFlashMLAMetadata,
        )

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> SupaFlashMLADecodeMetadata:
        return SupaFlashMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            max_seq_len=max_seq_len,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> SupaFlashMLAMetadata:
        """A replay re-reads seq_lens and the block table (views of the
        runner's persistent buffers) but keeps host values: gather the whole
        block table so every decode batch of this size fits."""
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if metadata.decode is not None:
            width = common_attn_metadata.block_table_tensor.shape[1]
            metadata.decode.max_seq_len = width * self.page_size
        return metadata


class SupaMLAPrefillBackend(MLAPrefillBackend):
    """The platform's MLA prefill backend: ragged attention with LSE.

    The metadata builder calls :meth:`prepare_metadata` once per step; the
    padding plans built there (and per context chunk, on first use) are
    shared by every layer of the step."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "SUPA_MLA_PREFILL"

    def supports_out(self) -> bool:
        return True

    def prepare_metadata(self, prefill_metadata: MLACommonPrefillMetadata) -> None:
        super().prepare_metadata(prefill_metadata)
        assert prefill_metadata.query_lens_cpu is not None
        self._new_tokens_plan = make_ragged_attention_plan(
            prefill_metadata.query_lens_cpu,
            causal=True,
            device=prefill_metadata.query_start_loc.device,
        )
        self._chunk_plans: dict[int, RaggedAttentionPlan] = {}

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if output_scale is not None:
            raise NotImplementedError("SUPA MLA prefill has no quantized output")
        return get_op("mla_prefill_attention")(
            q,
            k,
            v,
            self.scale,
            self._new_tokens_plan,
            return_lse=return_softmax_lse,
            out=out,
        )

    def run_prefill_context_chunk(
        self,
        chunk: MLACommonPrefillMetadata.ContextChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._chunk_plans.get(chunk.index)
        if plan is None:
            query_lens = self._prefill_metadata.query_lens_cpu
            assert query_lens is not None
            plan = self._chunk_plans[chunk.index] = make_ragged_attention_plan(
                query_lens[chunk.request_slice],
                chunk.seq_lens,
                causal=False,
                device=q.device,
            )
        return get_op("mla_prefill_attention")(
            q, k, v, self.scale, plan, return_lse=True, out=out
        )


class SupaFlashMLAImpl(MLACommonImpl[SupaFlashMLAMetadata]):
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
        **mla_args,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                "SUPA_FLASH_MLA does not support ALiBi, sliding window or "
                "logits soft-cap."
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"SUPA_FLASH_MLA does not support attention type {attn_type}."
            )
        if kv_cache_dtype not in ("auto", "bfloat16"):
            raise NotImplementedError(
                f"SUPA_FLASH_MLA does not support kv_cache_dtype={kv_cache_dtype!r}."
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        if self.dcp_world_size > 1:
            raise NotImplementedError(
                "SUPA_FLASH_MLA does not support decode context parallelism."
            )
        # No fp8 query (or fused concat kernels) on SUPA.
        self.supports_quant_query_input = False
        self._use_flashinfer_concat_mla_k = False
        self.kv_b_weight: torch.Tensor | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Keep a quantized ``kv_b_proj``'s weight dequantized for the
        prefill's up-projection. The absorbed decode multiplies by the
        dequantized weight (vLLM's ``W_UK`` / ``W_UV``); vLLM's own prefill
        runs the quantized GEMM instead, which for W8A8 also quantizes the
        latent per token, so a token's result would depend on whether its
        batch prefilled or decoded it. Here both compute the same function,
        at the cost of one dequantized copy of ``kv_b_proj`` per layer."""
        super().process_weights_after_loading(act_dtype)
        if not isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod):
            self.kv_b_weight = get_and_maybe_dequant_weights(
                self.kv_b_proj, out_dtype=act_dtype
            )

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
        attn_metadata: SupaFlashMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Absorbed decode: ``q`` is ``(q_nope @ W_UK, q_pe)`` per head; the
        result ``[tokens, N, kv_lora_rank]`` is up-projected by the layer.
        Speculative decoding verifies ``q_len`` tokens per request (uniform):
        token ``j`` of a request is decoded as a request of its own that ends
        ``q_len - 1 - j`` tokens early (causal within the query)."""
        decode = attn_metadata.decode
        assert decode is not None
        block_table, seq_lens = decode.block_table, decode.seq_lens
        num_decodes = attn_metadata.num_decodes
        q_len = attn_metadata.num_decode_tokens // max(num_decodes, 1)
        if q_len > 1:
            back = torch.arange(q_len - 1, -1, -1, device=seq_lens.device)
            seq_lens = (seq_lens[:num_decodes, None] - back).reshape(-1)
            block_table = block_table[:num_decodes].repeat_interleave(q_len, dim=0)
        out, _ = get_op("mla_decode")(
            q,
            kv_c_and_k_pe_cache,
            block_table,
            seq_lens,
            self.scale,
            self.kv_lora_rank,
            max_seq_len=decode.max_seq_len,
        )
        return out, None

    def forward_mha(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: SupaFlashMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """vLLM's MLA prefill (MLACommonBaseImpl.forward_mha) on the plugin's
        ops: the new tokens' latent is up-projected through ``kv_b_proj``
        and attends causally; with cached context (prefix hit, later chunk of
        a chunked prefill) the context is attended chunk by chunk and the
        parts are merged by their LSEs."""
        if output_scale is not None:
            raise NotImplementedError("SUPA_FLASH_MLA has no quantized output")
        prefill = attn_metadata.prefill
        assert prefill is not None and prefill.prefill_backend is not None
        backend = prefill.prefill_backend
        k, v = self._up_project(kv_c_normed, k_pe)
        out = output.view(-1, self.num_heads, self.v_head_dim)
        if prefill.chunked_context is None:
            backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=False, out=out)
            return
        suffix, suffix_lse = backend.run_prefill_new_tokens(
            q, k, v, return_softmax_lse=True
        )
        prefix, prefix_lse = self._compute_prefill_context(
            q, kv_c_and_k_pe_cache, attn_metadata, k_scale
        )
        get_op("merge_attn_states")(out, prefix, prefix_lse, suffix, suffix_lse)

    def _compute_prefill_context(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: SupaFlashMLAMetadata,
        k_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the prefill queries over their cached context, one
        workspace chunk at a time (vLLM's plan), merged into a running
        float32 partial; tokens without context keep ``(0, -inf)``."""
        prefill = attn_metadata.prefill
        assert prefill is not None and prefill.prefill_backend is not None
        context = prefill.chunked_context
        assert context is not None
        gather = get_op("gather_mla_context")
        merge = get_op("merge_attn_states")
        num_tokens = q.shape[0]
        output = q.new_zeros(
            (num_tokens, self.num_heads, self.v_head_dim), dtype=torch.float32
        )
        output_lse = q.new_full(
            (self.num_heads, num_tokens), float("-inf"), dtype=torch.float32
        )
        workspace = context.workspace
        for chunk in context.chunks:  # workspace-sized chunks, not requests
            toks = chunk.num_context_tokens
            gather(
                kv_c_and_k_pe_cache,
                prefill.block_table[chunk.request_slice],
                chunk.starts,
                chunk.cu_seq_lens,
                chunk.token_to_seq,
                workspace,
            )
            latent = workspace[:toks]
            k, v = self._up_project(
                latent[..., : self.kv_lora_rank],
                latent[..., self.kv_lora_rank :].unsqueeze(1),
            )
            part, part_lse = prefill.prefill_backend.run_prefill_context_chunk(
                chunk=chunk, q=q[chunk.token_slice], k=k, v=v
            )
            ts = chunk.token_slice
            merge(
                output[ts],
                output[ts],
                output_lse[:, ts],
                part,
                part_lse,
                output_lse=output_lse[:, ts],
            )
        return output, output_lse

    def _up_project(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[T, L]`` and rope key ``[T, 1, R]`` -> per-head keys
        ``[T, N, P + R]`` and values ``[T, N, V]`` through ``kv_b_proj``
        (its dequantized weight where it is quantized)."""
        kv_nope = (
            self.kv_b_proj(kv_c)[0]
            if self.kv_b_weight is None
            else get_op("linear")(kv_c, self.kv_b_weight, None)
        ).view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return self._concat_k_nope_k_pe(k_nope, k_pe.to(k_nope.dtype)), v


# Importing the backend (e.g. through the class path the platform returns)
# makes its name resolvable even if the general plugin has not run yet.
register_attention_backends()
