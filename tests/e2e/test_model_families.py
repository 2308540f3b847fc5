"""Other decoder families served through the plugin equal a reference.

One tiny random checkpoint per family (``tests/fixtures/tiny_families``),
one engine per family and dtype on the cpu backend. Prompts of 1 to 300
tokens (two around the block size of 128), all batched together.

- Qwen2, Qwen3, GLM-4, GLM and GLM-4-MoE are built from their own
  transformers classes and compared against HF ``generate``.
- ChatGLM and InternLM2 have no native transformers class (their modeling
  code is remote code only), so their checkpoints are written in the
  released layout and compared against an independent plain-PyTorch
  reference of the same weights (``tests/fixtures/plain_reference``, itself
  checked against transformers' Glm / Llama classes in
  ``tests/unit/test_plain_reference.py``).

float32: identical greedy tokens. bfloat16: vLLM's ``check_logprobs_close``
rule against the reference run in bfloat16. Each float32 test also checks,
inside the worker, which vLLM model class serves the architecture and that
the plugin's attention backend and layers (rotary with the family's rotary
dim and pair style included, the fused-MoE method and its grouped top-k
routing for GLM-4-MoE) are the ones that run, and counts the MoE ops' calls.
"""

from __future__ import annotations

import pytest

from tests.fixtures.engine import (
    check_logprobs_close,
    count_op_calls,
    llm_engine,
    op_calls,
    token_ids,
    vllm_logprobs,
    worker_facts,
)
from tests.fixtures.hf_reference import hf_greedy_logprobs
from tests.fixtures.tiny_families import (
    ALL_FAMILIES,
    REMOTE_CODE_FAMILIES,
    build_tiny_family,
)
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

LENGTHS = [1, 40, 128, 129, 300]
MAX_TOKENS = 12
NUM_LOGPROBS = 5

# Every family in bfloat16 too: its reference (HF or the plain-PyTorch one)
# run in bfloat16 on the same weights.
BF16_FAMILIES = ALL_FAMILIES


def _families(names):
    """One param per family. GLM runs on vLLM's Transformers modeling
    backend, the slowest family on the stand-in, whose tier has no time left
    for it: it runs in the cpu tiers only (cpu_backend)."""
    for name in names:
        marks = [pytest.mark.cpu_backend] if name == "glm" else []
        yield pytest.param(name, marks=marks, id=name)


# Engine arguments a family needs beyond the test's.
ENGINE_KWARGS = {
    # InternLM2's config class is remote code (configuration_internlm2.py in
    # the checkpoint folder, imported locally). ChatGLM needs nothing: vLLM
    # reads model_type "chatglm" with its own ChatGLMConfig.
    "internlm2": dict(trust_remote_code=True),
    # vLLM's Transformers modeling backend decorates transformers' own
    # GlmModel class in place (support_torch_compile), which would break the
    # HF reference of later tests in this process.
    "glm": dict(own_process=True),
}

# The plugin layers every model natively written for vLLM runs (as Llama).
_NATIVE_LAYERS = {
    "SUPARMSNorm", "SUPASiluAndMul", "SUPARotaryEmbedding",
    "SUPAVocabParallelEmbedding", "SUPALogitsProcessor",
    "SUPAQKVParallelLinear", "SUPAMergedColumnParallelLinear",
    "SUPARowParallelLinear",
}  # fmt: skip

# family -> (vLLM model class, plugin layers that must run, rotary embeddings
# as (class, head_size, rotary_dim, is_neox_style))
SERVED = {
    "qwen2": (
        "Qwen2ForCausalLM",
        _NATIVE_LAYERS,
        [("SUPARotaryEmbedding", 16, 16, True)],
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        _NATIVE_LAYERS,
        [("SUPARotaryEmbedding", 32, 32, True)],
    ),
    # Partial rotary: half of each 32-channel head, GPT-J (interleaved) pairs.
    "glm4": (
        "Glm4ForCausalLM",
        _NATIVE_LAYERS,
        [("SUPARotaryEmbedding", 32, 16, False)],
    ),
    # vLLM 0.33 has no native GlmForCausalLM: its Transformers modeling
    # backend runs HF's modules on vLLM's layers: fused q/k/v, the norms as
    # the backend's TPAwareRMSNorm, the single gate_up_proj as a column
    # linear; rotary and SiLU stay HF's own code.
    "glm": (
        "TransformersForCausalLM",
        {
            "SUPATPAwareRMSNorm", "SUPAVocabParallelEmbedding",
            "SUPALogitsProcessor", "SUPAQKVParallelLinear",
            "SUPAColumnParallelLinear", "SUPARowParallelLinear",
        },
        [],
    ),
    # MQA with 2 KV groups; rotary over half of each 16-channel head in
    # interleaved pairs (original_rope); one packed query_key_value.
    "chatglm": (
        "ChatGLMForCausalLM",
        _NATIVE_LAYERS,
        [("SUPARotaryEmbedding", 16, 8, False)],
    ),
    # The packed wqkv is one QKVParallelLinear, split by the model per KV
    # head; w1/w3 are stacked into gate_up_proj on load.
    "internlm2": (
        "InternLM2ForCausalLM",
        _NATIVE_LAYERS,
        [("SUPARotaryEmbedding", 16, 16, True)],
    ),
    # Partial rotary, NeoX pairs; the MoE layers run the plugin's fused MoE
    # after its float32 router GEMM (GateLinear); the shared expert is a
    # plain MLP of the native linear layers.
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        _NATIVE_LAYERS | {"SUPAUnquantizedFusedMoEMethod", "SUPAGateLinear"},
        [("SUPARotaryEmbedding", 32, 16, True)],
    ),
}  # fmt: skip

# Plugin ops a family's layers must call at every step (beyond the dense ones).
OPS_CALLED = {"glm4_moe": ("grouped_topk", "fused_experts")}


def family_facts(worker) -> dict:
    """Inside the worker: :func:`worker_facts`, the model class, every
    rotary embedding's shape and pair style, and the CustomOps that are not
    the plugin's (their ``forward_oot`` is vLLM's fallback to its native
    code, which ``custom_op_dispatch`` alone does not show). CustomOps inside
    a plugin layer do not count: its ``forward_oot`` replaces theirs (e.g.
    RotaryEmbedding's ``apply_rotary_emb``)."""
    from vllm.model_executor.custom_op import CustomOp

    def ours(module) -> bool:
        return type(module).__module__.startswith("vllm_br.")

    facts = worker_facts(worker)
    model = getattr(worker, "worker", worker).model_runner.get_model()
    facts["model_class"] = type(model).__name__
    modules = dict(model.named_modules())
    inside_ours = {
        name
        for parent, module in modules.items()
        if ours(module)
        for name in modules
        if name.startswith(parent + ".")
    }
    facts["foreign_custom_ops"] = sorted(
        {
            f"{type(m).__module__}.{type(m).__qualname__}"
            for name, m in modules.items()
            if isinstance(m, CustomOp) and not ours(m) and name not in inside_ours
        }
    )
    facts["rotary"] = sorted(
        {
            (type(m).__name__, m.head_size, m.rotary_dim, m.is_neox_style)
            for m in model.modules()
            if hasattr(m, "rotary_dim") and hasattr(m, "cos_sin_cache")
        }
    )
    return facts


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family -> its tiny float32 checkpoint, built once per module (the
    float32 and bfloat16 tests share it)."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = build_tiny_family(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def _prompts(model_dir):
    # Every tiny family has the same fast tokenizer. Not AutoTokenizer: for
    # ChatGLM / InternLM2 it reads config.json's auto_map and asks (15 s
    # timeout) whether to run remote code this process does not have.
    from transformers import PreTrainedTokenizerFast

    return prompt_token_ids_of_lengths(
        PreTrainedTokenizerFast.from_pretrained(model_dir), LENGTHS, seed=2
    )


def reference_greedy_logprobs(family, model_dir, prompts, num_logprobs, dtype):
    """HF transformers ``generate`` where transformers has the family's class;
    the plain-PyTorch reference where it has none."""
    if family in REMOTE_CODE_FAMILIES:
        from tests.fixtures.plain_reference import greedy_logprobs

        return greedy_logprobs(model_dir, prompts, MAX_TOKENS, num_logprobs, dtype)
    return hf_greedy_logprobs(model_dir, prompts, MAX_TOKENS, num_logprobs, dtype)


def _greedy(logprobs=None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


@pytest.mark.parametrize("family", list(_families(ALL_FAMILIES)))
def test_float32_greedy_identical_to_reference(family, family_dir):
    model_dir = family_dir(family)
    prompts = _prompts(model_dir)
    reference = reference_greedy_logprobs(family, model_dir, prompts, 2, "float32")
    expected = [ids for ids, _text, _steps in reference]
    # The reference is decisive (no float32 near-ties) and not degenerate
    # (prompts continue differently, with varied tokens), so a mismatch below
    # is the plugin's, not the fixture's.
    assert len({tuple(ids) for ids in expected}) == len(prompts), expected
    assert len({t for ids in expected for t in ids}) > 2 * len(prompts), expected
    for _ids, _text, steps in reference:
        for step in steps:
            first, second = sorted(step.values(), reverse=True)
            assert first - second > 1e-3, step

    model_class, layers, rotary = SERVED[family]
    with llm_engine(
        model_dir, dtype="float32", max_model_len=512, **ENGINE_KWARGS.get(family, {})
    ) as llm:
        facts = llm.collective_rpc(family_facts)[0]
        counted = OPS_CALLED.get(family, ())
        llm.collective_rpc(count_op_calls, args=(counted,))
        got = token_ids(_generate(llm, prompts, _greedy()))
        calls = llm.collective_rpc(op_calls)[0]

    assert facts["platform"] == "SUPAPlatform"
    assert facts["model_runner"] == "SUPAModelRunner"
    assert facts["model_class"] == model_class
    assert facts["attn_backends"] == ["SUPAFlashAttentionBackend"]
    assert facts["block_size"] == 128
    assert layers <= set(facts["plugin_layers"]), facts["plugin_layers"]
    assert facts["rotary"] == rotary
    assert all(
        method == "forward_oot" for method in facts["custom_op_dispatch"].values()
    ), facts["custom_op_dispatch"]
    assert facts["foreign_custom_ops"] == []
    assert all(calls[name] >= MAX_TOKENS for name in counted), calls
    assert got == expected


@pytest.mark.parametrize("family", list(_families(BF16_FAMILIES)))
def test_bfloat16_follows_check_logprobs_close(family, family_dir):
    model_dir = family_dir(family)
    prompts = _prompts(model_dir)
    reference = [
        (ids, steps)
        for ids, _text, steps in reference_greedy_logprobs(
            family, model_dir, prompts, NUM_LOGPROBS, "bfloat16"
        )
    ]
    with llm_engine(
        model_dir, dtype="bfloat16", max_model_len=512, **ENGINE_KWARGS.get(family, {})
    ) as llm:
        tested = vllm_logprobs(_generate(llm, prompts, _greedy(NUM_LOGPROBS)))
    parted = check_logprobs_close(reference, tested)
    assert sum(p is None for p in parted) >= len(prompts) // 2, parted
