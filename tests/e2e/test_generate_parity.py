"""Greedy output through the plugin equals HF transformers ``generate``.

Models: the tiny random Llama (fixture) and SmolLM2-135M-Instruct (the
default model). Prompts have lengths around the block size of 128 and one of
about 600 tokens, all batched together. float32: identical tokens. bfloat16:
identical, or vLLM's ``check_logprobs_close`` rule where they part.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

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
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths
from vllm_br import compat

pytestmark = pytest.mark.e2e

LENGTHS = [1, 127, 128, 129, 255, 256, 257, 600, 7, 40]
MAX_TOKENS = 12
NUM_LOGPROBS = 5


@contextmanager
def captured_vllm_logs():
    """The records vLLM's and the plugin's loggers (all under "vllm") emit."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    root = logging.getLogger("vllm")
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


def _greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )


def _prompts(model_dir, tokenizer: bool):
    if tokenizer:
        from transformers import AutoTokenizer

        return prompt_token_ids_of_lengths(
            AutoTokenizer.from_pretrained(model_dir), LENGTHS
        )
    return prompt_token_ids_of_lengths(512, LENGTHS)


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


@pytest.fixture(scope="module", params=["tiny_llama", "smollm2"])
def model(request):
    name = request.param
    model_dir = request.getfixturevalue(f"{name}_dir")
    return name, model_dir, _prompts(model_dir, tokenizer=(name == "smollm2"))


@pytest.fixture(scope="module")
def hf_float32(model):
    """HF's float32 greedy tokens for the model's prompts, computed once
    (two tests compare against them)."""
    _name, model_dir, prompts = model
    return hf_greedy(model_dir, prompts, MAX_TOKENS, "float32")


def test_float32_identical_batched_with_prefix_cache(model, hf_float32):
    """All prompts in one batch; then the long ones again, served from the
    prefix cache (hits confirmed by vLLM's counters), still identical."""
    name, model_dir, prompts = model
    expected = hf_float32
    # The tiny Llama's engine has its own process: its KV cache is sized from
    # the emulated device's memory as a user's is (in-process engines get a
    # fixed one). The sizing is the same check for both models, so SmolLM2
    # runs in the test process (~10 s less).
    sized = name == "tiny_llama"
    with llm_engine(
        model_dir, dtype="float32", enable_prefix_caching=True, own_process=sized
    ) as llm:
        facts = llm.collective_rpc(worker_facts)[0]
        assert facts["platform"] == "SUPAPlatform"
        assert facts["worker"] == "SUPAWorker"
        assert facts["model_runner"] == "SUPAModelRunner"
        assert facts["attn_backends"] == ["SUPAFlashAttentionBackend"]
        assert facts["block_size"] == 128
        # KV cache sized from the device's memory (on cpu the emulated
        # device's, VLLM_BR_CPU_MEMORY_GIB in tests/e2e/conftest.py; on the
        # stand-in its 2 GiB cards) times --gpu-memory-utilization.
        limit = facts["gpu_memory_utilization"] * facts["device_total_memory"]
        assert 0 < facts["kv_cache_bytes"] <= limit
        # The plugin's layers serve every op, not vLLM's native fallbacks.
        expected_layers = {
            "SUPARMSNorm", "SUPASiluAndMul", "SUPARotaryEmbedding",
            "SUPAVocabParallelEmbedding", "SUPALogitsProcessor",
            "SUPAQKVParallelLinear", "SUPAMergedColumnParallelLinear",
            "SUPARowParallelLinear",
        }  # fmt: skip
        assert expected_layers <= set(facts["plugin_layers"]), facts["plugin_layers"]
        assert all(
            method == "forward_oot" for method in facts["custom_op_dispatch"].values()
        ), facts["custom_op_dispatch"]

        got = token_ids(_generate(llm, prompts, _greedy()))
        assert got == expected

        hits_before = counter(llm, "vllm:prefix_cache_hits")
        again = [prompts[LENGTHS.index(n)] for n in (257, 600, 129)]
        got_again = token_ids(_generate(llm, again, _greedy()))
        hits = counter(llm, "vllm:prefix_cache_hits") - hits_before
        # 257 -> 2 full blocks, 600 -> 4 full blocks, 129 -> 1 full block cached.
        assert hits >= 7 * 128, f"expected prefix-cache hits, got {hits}"
        assert got_again == [expected[LENGTHS.index(n)] for n in (257, 600, 129)]


@pytest.mark.parametrize(
    "model",
    # SmolLM2 in the slow tier (~14 s): the tiny Llama cuts its prefills into
    # the same 32-token chunks in the default one.
    ["tiny_llama", pytest.param("smollm2", marks=pytest.mark.slow)],
    indirect=True,
)
def test_float32_identical_with_small_prefill_chunks(model, hf_float32):
    """Chunked prefill forced to 32-token chunks mixes partial prefills with
    decodes in every step; the tokens stay identical."""
    name, model_dir, prompts = model
    expected = hf_float32
    with llm_engine(
        model_dir,
        dtype="float32",
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=32,
        max_num_seqs=4,
        enable_prefix_caching=False,
    ) as llm:
        assert token_ids(_generate(llm, prompts, _greedy())) == expected


def test_bfloat16_follows_check_logprobs_close(model):
    name, model_dir, prompts = model
    reference = [
        (ids, steps)
        for ids, _text, steps in hf_greedy_logprobs(
            model_dir, prompts, MAX_TOKENS, NUM_LOGPROBS, "bfloat16"
        )
    ]
    with captured_vllm_logs() as records:
        with llm_engine(model_dir, dtype="bfloat16") as llm:
            tested = vllm_logprobs(
                _generate(llm, prompts, _greedy(logprobs=NUM_LOGPROBS))
            )
    parted = check_logprobs_close(reference, tested)
    # Most prompts agree over every step in bf16 as well.
    assert sum(p is None for p in parted) >= len(prompts) // 2, parted
    # The folder stores float32 weights: one summary line at load, not one
    # vLLM warning per weight.
    per_weight = [r for r in records if r.msg == compat.WEIGHT_DTYPE_WARNING]
    assert not per_weight, per_weight[:3]
    summary = [
        r.getMessage()
        for r in records
        if "weights stored in float32 are served in bfloat16" in r.getMessage()
    ]
    assert len(summary) == 1, summary


def test_seeded_sampling_repeats(tiny_llama_dir):
    """temperature / top-p / top-k with a seed: same tokens run to run, and
    different seeds give different tokens (so it really samples)."""
    from vllm import SamplingParams

    prompts = prompt_token_ids_of_lengths(512, [5, 130, 64, 17], seed=3)

    def params(seed):
        return SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=40,
            seed=seed,
            max_tokens=24,
            ignore_eos=True,
        )

    with llm_engine(tiny_llama_dir, dtype="float32") as llm:
        first = token_ids(_generate(llm, prompts, params(1234)))
        second = token_ids(_generate(llm, prompts, params(1234)))
        other = token_ids(_generate(llm, prompts, params(99)))
    assert first == second
    assert first != other
