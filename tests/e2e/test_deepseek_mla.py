"""DeepSeek V2 and V3 (MLA + MoE) served through the plugin equal HF
transformers.

Tiny random checkpoints from transformers' own DeepSeek classes
(``tests/fixtures/tiny_deepseek``): V2 without a query LoRA, softmax routing
limited to the best expert groups; V3 with a query LoRA, sigmoid routing with
a correction bias and ``routed_scaling_factor``; both a dense first layer,
then MoE layers with a shared expert. Prompts of 1 to 300 tokens (around the
block size of 128), all batched together, then two prompts that share the
first 256 / 128 tokens of the 300-token one (prefix-cache hits: their
prefill attends cached context).

- float32: identical greedy tokens. The V2 engine schedules whole prefills,
  so its first batch runs no context attention and the prefix hits do; the
  V3 engine chunks prefills (``max_num_batched_tokens`` 96), so the long
  prompts' later chunks attend their own earlier ones, mixed with decodes.
  Inside the worker: SupaFlashMLABackend with its impl and the platform's
  MLA prefill backend serve every attention layer over a 128-token-block
  latent cache, and the plugin's ops ran (counted): latent write, absorbed
  decode, ragged prefill, and for context the gather and the LSE merge; the
  MoE layers routed through ``grouped_topk`` with each version's settings.
- bfloat16: vLLM's ``check_logprobs_close`` rule against HF in bfloat16.
"""

from __future__ import annotations

import pytest

from tests.fixtures.engine import (
    check_logprobs_close,
    counter,
    llm_engine,
    token_ids,
    vllm_logprobs,
    worker_facts,
)
from tests.fixtures.hf_reference import hf_greedy, hf_greedy_logprobs
from tests.fixtures.tiny_deepseek import MLA_DIMS, build_tiny_deepseek
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

LENGTHS = [1, 40, 127, 129, 300]
MAX_TOKENS = 10
NUM_LOGPROBS = 5
ENGINE = dict(max_model_len=512)
# V3 float32: prefills chunked to 96 tokens per step.
CHUNKED = dict(max_num_batched_tokens=96, enable_chunked_prefill=True)
LATENT = MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]

# version -> (vLLM model class, q_lora_rank, the grouped_topk call: groups,
# topk_group, scoring, has correction bias, renormalize, weight scale). The
# weight scale is 1: vLLM's DeepseekV2MoE applies routed_scaling_factor to
# the MoE output instead (apply_routed_scale_to_output), which the identical
# tokens check.
EXPECTED = {
    "v2": ("DeepseekV2ForCausalLM", None, (4, 2, "softmax", False, False, 1.0)),
    "v3": ("DeepseekV3ForCausalLM", 32, (4, 2, "sigmoid", True, True, 1.0)),
}

_COUNTED = (
    "concat_and_cache_mla",
    "mla_decode",
    "mla_prefill_attention",
    "gather_mla_context",
    "merge_attn_states",
    "grouped_topk",
    "fused_experts",
)


def count_ops(worker) -> None:
    """Inside the worker: wrap the resolved plugin ops so each call is
    counted (and grouped_topk's routing settings recorded)."""
    from vllm_br.ops import registry

    # Fresh records: an in-process engine shares this module with the
    # engines before it.
    calls = registry._test_calls = {}
    routing = registry._test_routing = set()
    for name in _COUNTED:
        fn = registry.get_op(name)
        calls[name] = 0

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            if _name == "grouped_topk":
                _, _, renorm, groups, topk_group, scoring, bias, scale = args
                routing.add(
                    (groups, topk_group, scoring, bias is not None, renorm, scale)
                )
            return _fn(*args, **kwargs)

        registry._RESOLVED[name] = wrapped


def op_calls(worker) -> dict:
    from vllm_br.ops import registry

    return {
        "calls": dict(registry._test_calls),
        "routing": sorted(registry._test_routing),
    }


def mla_facts(worker) -> dict:
    """Inside the worker: what serves each MLA layer and its cache."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    facts = worker_facts(worker)
    model = getattr(worker, "worker", worker).model_runner.get_model()
    facts["model_class"] = type(model).__name__
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    facts["mla_layers"] = len(layers)
    facts["mla"] = sorted(
        {
            (
                m.attn_backend.__name__,
                type(m.impl).__name__,
                type(m.prefill_backend).__name__,
                m.q_lora_rank,
                "x".join(map(str, m.kv_cache.shape[1:])),
            )
            for m in layers
        }
    )
    moe = [m.mlp for m in model.model.layers if type(m.mlp).__name__ == "DeepseekV2MoE"]
    facts["moe_layers"] = len(moe)
    facts["shared_experts"] = all(m.shared_experts is not None for m in moe)
    return facts


def _greedy(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """version -> (its tiny float32 checkpoint, prompts, prefix-hit prompts),
    built once per module."""
    from transformers import AutoTokenizer

    built = {}

    def get(version):
        if version not in built:
            path = build_tiny_deepseek(version, tmp_path_factory.mktemp(version))
            tokenizer = AutoTokenizer.from_pretrained(path)
            prompts = prompt_token_ids_of_lengths(tokenizer, LENGTHS, seed=3)
            other = prompt_token_ids_of_lengths(tokenizer, [20, 30], seed=4)
            long = prompts[-1]
            hits = [long[:256] + other[0], long[:128] + other[1]]
            built[version] = (path, prompts, hits)
        return built[version]

    return get


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_float32_identical_to_hf_with_chunked_prefill_and_prefix_hits(
    version, deepseek
):
    path, prompts, hits = deepseek(version)
    expected = hf_greedy(path, prompts + hits, MAX_TOKENS, "float32")
    chunked = version == "v3"
    kwargs = {**ENGINE, **(CHUNKED if chunked else {})}
    with llm_engine(path, dtype="float32", enable_prefix_caching=True, **kwargs) as llm:
        facts = llm.collective_rpc(mla_facts)[0]
        llm.collective_rpc(count_ops)

        assert token_ids(_generate(llm, prompts, _greedy())) == expected[:-2]
        first = llm.collective_rpc(op_calls)[0]["calls"]
        hits_before = counter(llm, "vllm:prefix_cache_hits")
        assert token_ids(_generate(llm, hits, _greedy())) == expected[-2:]
        hit_tokens = counter(llm, "vllm:prefix_cache_hits") - hits_before
        ops = llm.collective_rpc(op_calls)[0]

    model_class, q_lora_rank, routing = EXPECTED[version]
    assert facts["platform"] == "SUPAPlatform"
    assert facts["model_class"] == model_class
    assert facts["attn_backends"] == ["SupaFlashMLABackend"]
    assert facts["block_size"] == 128
    # Every layer: our backend, impl and prefill backend, the latent cache
    # [num_blocks, 128, kv_lora_rank + rope] (one 48-wide entry per token).
    # (Tuples may come back from the worker as lists.)
    assert facts["mla_layers"] == 3
    assert [list(layer) for layer in facts["mla"]] == [
        [
            "SupaFlashMLABackend",
            "SupaFlashMLAImpl",
            "SupaMLAPrefillBackend",
            q_lora_rank,
            f"128x{LATENT}",
        ]
    ]
    # Dense first layer, then MoE layers with a shared expert.
    assert facts["moe_layers"] == 2 and facts["shared_experts"]
    assert "SUPAUnquantizedFusedMoEMethod" in facts["plugin_layers"]

    # The plugin's MLA ops ran; context attention (gather + merge) ran in
    # the first batch only where prefills were chunked, and for the hits.
    calls = ops["calls"]
    for name in _COUNTED:
        assert calls[name] > 0, (name, calls)
    assert (first["gather_mla_context"] > 0) == chunked, first
    assert calls["gather_mla_context"] > first["gather_mla_context"]
    assert hit_tokens >= 256 + 128
    assert [list(r) for r in ops["routing"]] == [list(routing)]


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_bfloat16_follows_check_logprobs_close(version, deepseek):
    path, prompts, _ = deepseek(version)
    reference = [
        (ids, steps)
        for ids, _text, steps in hf_greedy_logprobs(
            path, prompts, MAX_TOKENS, NUM_LOGPROBS, "bfloat16"
        )
    ]
    with llm_engine(path, dtype="bfloat16", **ENGINE) as llm:
        assert llm.collective_rpc(worker_facts)[0]["attn_backends"] == [
            "SupaFlashMLABackend"
        ]
        tested = vllm_logprobs(_generate(llm, prompts, _greedy(logprobs=NUM_LOGPROBS)))
    parted = check_logprobs_close(reference, tested)
    assert sum(p is None for p in parted) >= len(prompts) // 2, parted
