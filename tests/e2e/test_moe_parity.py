"""A Mixture-of-Experts model served through the plugin equals HF transformers.

The tiny random Qwen3-MoE (fixture: 8 experts, top-2, one dense layer) with
prompts of 1 to 300 tokens, all batched together: the first step's ~480
prefill tokens take the dynamic expert path (more than
VLLM_BR_STATIC_MOE_DECODER_MAX_LEN = 256 tokens), the decode steps of the
batch the static dense one (5 tokens x 2 experts > 8 experts) and a single
request's decode the static gather one (1 x 2 <= 8). float32: identical
tokens. bfloat16: vLLM's ``check_logprobs_close`` rule.
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
from tests.fixtures.hf_reference import hf_greedy, hf_greedy_logprobs
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

LENGTHS = [1, 7, 40, 129, 300]
MAX_TOKENS = 12
NUM_LOGPROBS = 5
MOE_OPS = ("fused_topk", "fused_experts")


def moe_facts(worker) -> dict:
    """Inside the worker: which MoE method each layer built, whether vLLM
    built a kernel of its own."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    worker = getattr(worker, "worker", worker)
    layers = [
        m
        for m in worker.model_runner.get_model().modules()
        if isinstance(m, RoutedExperts)
    ]
    return {
        "methods": sorted({type(m.quant_method).__name__ for m in layers}),
        "num_layers": len(layers),
        "monolithic": all(m.quant_method.is_monolithic for m in layers),
        "vllm_kernels": [
            m.quant_method.moe_kernel for m in layers if m.quant_method.moe_kernel
        ],
    }


def _greedy(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


@pytest.fixture(scope="module")
def prompts():
    return prompt_token_ids_of_lengths(512, LENGTHS, seed=1)


def test_float32_identical_and_served_by_the_plugin(tiny_qwen3_moe_dir, prompts):
    expected = hf_greedy(tiny_qwen3_moe_dir, prompts, MAX_TOKENS, "float32")
    with llm_engine(tiny_qwen3_moe_dir, dtype="float32") as llm:
        facts = llm.collective_rpc(worker_facts)[0]
        assert facts["platform"] == "SUPAPlatform"
        assert "SUPAUnquantizedFusedMoEMethod" in facts["plugin_layers"]
        assert (
            facts["custom_op_dispatch"]["SUPAUnquantizedFusedMoEMethod"]
            == "forward_oot"
        )

        llm.collective_rpc(count_op_calls, args=(MOE_OPS,))
        assert token_ids(_generate(llm, prompts, _greedy())) == expected
        calls = llm.collective_rpc(op_calls)[0]
        single = token_ids(_generate(llm, [prompts[3]], _greedy()))
        assert single == [expected[3]]

        moe = llm.collective_rpc(moe_facts)[0]
    # Layers 0 and 2 are sparse; vLLM's router and kernels never ran (it
    # built none), the plugin's ops did.
    assert moe["methods"] == ["SUPAUnquantizedFusedMoEMethod"]
    assert moe["num_layers"] == 2 and moe["monolithic"]
    assert moe["vllm_kernels"] == []
    # Two sparse layers: at least two calls of each op per forward step.
    assert all(calls[name] >= 2 * MAX_TOKENS for name in MOE_OPS), calls


def test_bfloat16_follows_check_logprobs_close(tiny_qwen3_moe_dir, prompts):
    reference = [
        (ids, steps)
        for ids, _text, steps in hf_greedy_logprobs(
            tiny_qwen3_moe_dir, prompts, MAX_TOKENS, NUM_LOGPROBS, "bfloat16"
        )
    ]
    with llm_engine(tiny_qwen3_moe_dir, dtype="bfloat16") as llm:
        tested = vllm_logprobs(_generate(llm, prompts, _greedy(logprobs=NUM_LOGPROBS)))
    parted = check_logprobs_close(reference, tested)
    assert sum(p is None for p in parted) >= len(prompts) // 2, parted


def captured_sizes(worker) -> list[int]:
    """Inside the worker: the token counts captured as graphs."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    return sorted(
        {
            size
            for wrapper in CUDAGraphWrapper._all_instances
            for size, entry in wrapper.concrete_cudagraph_entries.items()
            if entry.cudagraph is not None
        },
        key=lambda d: getattr(d, "num_tokens", d),
    )


@pytest.mark.supa_backend
def test_default_graphs_stop_at_the_static_moe_limit(
    tiny_qwen3_moe_dir, prompts, monkeypatch
):
    """`LLM(model=<MoE>)` with supa's default graphs and vLLM's default
    sizes: a graph may only capture the static MoE path, so the largest size
    is VLLM_BR_STATIC_MOE_DECODER_MAX_LEN (here 16; vLLM alone would capture
    up to 512 tokens and the capture failed, "a SUPA graph cannot synchronize
    with the host"); larger batches run without graphs, and the tokens are
    HF's."""
    monkeypatch.setenv("VLLM_BR_STATIC_MOE_DECODER_MAX_LEN", "16")
    expected = hf_greedy(tiny_qwen3_moe_dir, prompts, MAX_TOKENS, "float32")
    with llm_engine(
        tiny_qwen3_moe_dir,
        dtype="float32",
        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},
    ) as llm:
        sizes = llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes
        assert token_ids(_generate(llm, prompts, _greedy())) == expected
        captured = llm.collective_rpc(captured_sizes)[0]
    assert max(sizes) == 16, sizes
    assert captured, "no graph was captured"
