"""Everything that depends on the vLLM version lives here.

The supported version is written once, in ``vllm_br._version``.
"""

from __future__ import annotations

import re
from importlib import metadata

from vllm_br._version import SUPPORTED_VLLM_VERSION
from vllm_br.logger import init_logger

logger = init_logger(__name__)


def installed_vllm_version() -> str:
    try:
        return metadata.version("vllm").split("+")[0]
    except metadata.PackageNotFoundError:  # pragma: no cover
        import vllm

        return vllm.__version__.split("+")[0]


def check_vllm_version() -> bool:
    """Warn once when the installed vLLM is not the supported release."""
    installed = installed_vllm_version()
    if installed != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "vllm-br supports vLLM %s but vLLM %s is installed; install vllm==%s.",
            SUPPORTED_VLLM_VERSION,
            installed,
            SUPPORTED_VLLM_VERSION,
        )
        return False
    return True


# vLLM 0.33 has only the V1 engine; VLLM_USE_V1 is read nowhere by vLLM.
HAS_V0_ENGINE = False

# vLLM 0.33 GPUModelRunner (Model Runner V1) builds its own streams/events
# through these torch.cuda names; the worker aliases them to the device layer.
CUDA_STREAM_EVENT_NAMES = (
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "default_stream",
)

# Triton kernels of vLLM 0.33 core that the runner launches on every step and
# that need a plain-torch implementation on SUPA (no Triton for SUPA).
SLOT_MAPPING_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
# Modules whose objects break vLLM 0.33's register_kernels scan over every
# module (vllm/triton_utils/dispatcher.py:137 reads vars(value).get): the
# ffi library object of llvmlite (imported with numba, which vLLM's n-gram
# proposer uses) answers any attribute, __dict__ included, with a function.
# They hold no Triton kernel; the scan skips them (worker/kernel_overrides.py).
KERNEL_SCAN_UNSAFE_MODULES = ("llvmlite.binding.ffi",)

# The speculative-decoding path's Triton kernels (rejection sampler, EAGLE and
# draft-model input preparation), by function name in each module; the plugin's
# plain-torch versions (spec_decode/kernels.py) keep the same function names.
SPEC_DECODE_KERNELS: dict[str, tuple[str, ...]] = {
    "vllm.v1.sample.rejection_sampler": (
        "rejection_greedy_sample_kernel",
        "rejection_random_sample_kernel",
        "expand_kernel",
        "sample_recovered_tokens_kernel",
    ),
    "vllm.v1.spec_decode.utils": (
        "eagle_step_slot_mapping_metadata_kernel",
        "eagle_prepare_inputs_padded_kernel",
        "eagle_prepare_next_token_padded_kernel",
        "copy_and_expand_eagle_inputs_kernel",
    ),
}

# vLLM 0.33's Ray executor (distributed_executor_backend="ray", RayExecutorV2):
# the module that creates the worker actors from its global RayWorkerProc, and
# ray_utils' wait for the workers' placement group (both looked up at call time).
RAY_EXECUTOR_MODULE = "vllm.v1.executor.ray_executor_v2"
RAY_WORKER_CLASS = "RayWorkerProc"
RAY_UTILS_MODULE = "vllm.v1.executor.ray_utils"
RAY_PLACEMENT_GROUP_WAIT = "_wait_until_pg_ready"


# vLLM 0.33's ModelRegistry error for an architecture it does not know; its
# message lists every supported architecture (thousands of characters).
_UNKNOWN_ARCH = re.compile(
    r"Model architectures (\[[^\]]*\]) are not supported for now"
)


def known_vllm_user_error(err: BaseException) -> str | None:
    """One sentence for a vLLM error a user caused, where vLLM's own is long."""
    match = _UNKNOWN_ARCH.search(str(err))
    if match:
        return (
            f"Model architecture {match.group(1)} is not one vLLM "
            f"{SUPPORTED_VLLM_VERSION} can serve; use a model whose config.json "
            "names a supported architecture."
        )
    return None


# vLLM 0.33's own refusals of a speculative configuration (raised while the
# config is built, vllm/config/speculative.py), as (setting, facts) for
# spec_decode/config.py to say in one sentence.
_SPEC_VOCAB = re.compile(
    r"Target and draft model should have the same vocabulary size\. "
    r"Target model vocab_size=(\d+)\. Draft model vocab_size=(\d+)\."
)
_SPEC_NO_METHOD = re.compile(r"Unsupported speculative method: '([^']*)'")
_SPEC_SUFFIX = "Arctic Inference is required for suffix decoding"


def speculative_config_error(err: BaseException) -> tuple[str, tuple] | None:
    """("method", (value,)), ("num_speculative_tokens", (value,)),
    ("vocab", (target, draft)), ("no_draft", (method,)) or ("unserved",
    (method,)) for vLLM's refusal ``err``, else None."""
    if type(err).__name__ == "ValidationError" and (
        getattr(err, "title", "") == "SpeculativeConfig"
    ):
        for e in err.errors():
            field = e.get("loc", ("",))[0] if e.get("loc") else ""
            if field in ("method", "num_speculative_tokens"):
                return field, (e.get("input"),)
    match = _SPEC_VOCAB.search(str(err))
    if match:
        return "vocab", (int(match.group(1)), int(match.group(2)))
    match = _SPEC_NO_METHOD.search(str(err))
    if match:
        return "no_draft", (match.group(1),)
    if _SPEC_SUFFIX in str(err):
        # vLLM looks for suffix decoding's package before any platform check.
        return "unserved", ("suffix",)
    return None


# ---- vLLM's private names ---------------------------------------------------
# Every private vLLM name the plugin calls, overrides, reads or assigns outside
# this module, as "module:Qualname.attr", with where and why.
# tests/unit/test_vllm_surface.py checks that each still exists in the
# installed vLLM, and that every private vLLM method a plugin class overrides
# is listed here: a vLLM upgrade that renames one fails there, not at serving.
VLLM_PRIVATE_NAMES: dict[str, str] = {
    # worker/worker.py: SUPAWorker builds and warms up its runner
    "vllm.v1.worker.gpu_worker:Worker._init_workspace_and_model_runner": (
        "called by SUPAWorker.init_device"
    ),
    "vllm.v1.worker.gpu_worker:Worker._make_model_runner": (
        "overridden: the runner is SUPAModelRunner"
    ),
    "vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context": (
        "overridden: no sleep-mode allocator on SUPA"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_run": (
        "compile warm-up and the sampler warm-up's hidden states"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_sampler_run": (
        "sampler warm-up at its largest shape"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_pooler_run": (
        "pooler warm-up for pooling models"
    ),
    # worker/model_runner.py: SUPAModelRunner
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sync_device": (
        "overridden: the device layer's synchronize"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._to_list": (
        "overridden: no pinned-memory event round trip"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_kv_zero_meta": (
        "overridden: KV blocks zeroed without vLLM's Triton zeroer"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": (
        "overridden: discarded requests' generators restored by state"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync": (
        "overridden: hides those generators from vLLM's Philox offset rewind"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.discard_request_mask": (
        "read by SUPAModelRunner._sample (requests whose token is discarded)"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._zero_block_ids": (
        "overridden: KV blocks zeroed without vLLM's Triton zeroer"
    ),
    # compilation/capture.py: SUPA graph capture on the runner's own loop
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._warmup_and_capture": (
        "warm-up runs, then the capturing dummy run"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_minimal_kv_cache_for_profiling": (
        "graph-memory estimate before the KV cache is sized"
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._cleanup_profiling_kv_cache": (
        "graph-memory estimate before the KV cache is sized"
    ),
    "vllm.compilation.cuda_graph:CUDAGraphWrapper._all_instances": (
        "the wrappers whose graphs are dropped after the estimate"
    ),
    # attention/backend.py and attention/mla.py
    "vllm.v1.attention.backend:AttentionMetadataBuilder._cudagraph_support": (
        "overridden by both metadata builders"
    ),
    "vllm.v1.attention.backend:AttentionMetadataBuilder._init_reorder_batch_threshold": (
        "decodes first in the batch"
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLACommonMetadataBuilder._build_decode": (
        "overridden: SUPA's decode metadata"
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLACommonBaseImpl._compute_prefill_context": (
        "overridden and called: prefill over cached context on SUPA"
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLACommonBaseImpl._concat_k_nope_k_pe": (
        "called when up-projecting the latent cache"
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLACommonBaseImpl._use_flashinfer_concat_mla_k": (
        "assigned False: no FlashInfer on SUPA"
    ),
    "vllm.v1.attention.backends.mla.prefill.base:MLAPrefillBackend._prefill_metadata": (
        "read after prepare_metadata"
    ),
    # layers/
    "vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits": (
        "called by the plugin's logits processor"
    ),
    "vllm.model_executor.layers.logits_processor:LogitsProcessor._apply_head": (
        "overridden: the compute_logits op"
    ),
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase._match_cos_sin_cache_dtype": (
        "called before the rotary op"
    ),
    "vllm.model_executor.layers.attention.mla_attention:MLAAttention._cpu_skip_gemm_dispatch": (
        "read by getattr on kv_b_proj, which vLLM marks for its CPU GEMMs"
    ),
    # platform.py, model_cache.py, executor/ray_worker.py
    "vllm.platforms.interface:Platform._enum": "assigned PlatformEnum.OOT",
    "vllm.logger:_configure_vllm_root_logger": (
        "re-applied after the default model's conversion"
    ),
    "vllm.v1.executor.ray_utils:_wait_until_pg_ready": (
        "patched (ledger: ray-executor-supa-devices)"
    ),
    # spec_decode/: the rejection sampler's longest draft and the kernels
    # replaced through vLLM's kernel dispatcher (SPEC_DECODE_KERNELS above)
    "vllm.v1.sample.rejection_sampler:MAX_SPEC_LEN": (
        "num_speculative_tokens is refused above it (spec_decode/config.py)"
    ),
    **{
        f"{module}:{name}": "replaced by vllm_br.spec_decode.kernels"
        for module, names in SPEC_DECODE_KERNELS.items()
        for name in names
    },
}


def rejection_sampler_max_spec_len() -> int:
    """The most draft tokens per request vLLM's rejection sampler takes."""
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler.MAX_SPEC_LEN


# vLLM 0.33 warns once per weight when a checkpoint's dtype differs from the
# parameter's (vllm/model_executor/models/utils.py:333); the worker turns the
# float32 -> model dtype ones into one line (worker/weight_casts.py).
WEIGHT_DTYPE_WARNING_LOGGER = "vllm.model_executor.models.utils"
WEIGHT_DTYPE_WARNING = (
    "Attempted to load weight %s with dtype %s into parameter with dtype %s"
)

# torch 2.13 warns when anything reads an attribute of the deprecated
# torch.distributed.reduce_op (torch/distributed/distributed_c10d.py:551);
# vLLM's register_kernels scan does (worker/kernel_overrides.py). A regex
# for warnings.filterwarnings.
TORCH_REDUCE_OP_WARNING = r"`torch\.distributed\.reduce_op` is deprecated"


def loaded_expert_biases(layer) -> set[str]:
    """Names of the expert biases vLLM 0.33's ``RoutedExperts`` weight loader
    found in the checkpoint (``routed_experts.py``: ``_loaded_expert_biases``;
    GPTQ MoE methods create bias parameters whether or not any are loaded)."""
    return set(getattr(layer, "_loaded_expert_biases", ()))


def online_moe_methods() -> dict:
    """vLLM 0.33's table of online MoE quant methods by weight QuantKey
    (``quantization/online/base.py``: ``_ONLINE_MOE_METHODS``), which the
    ``--quantization`` shorthands such as ``int8_per_channel_weight_only``
    resolve through."""
    from vllm.model_executor.layers.quantization.online import base

    return base._ONLINE_MOE_METHODS
