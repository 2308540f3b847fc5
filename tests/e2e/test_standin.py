"""The supa backend end to end on the stand-in SUPA device (tests/standin/).

The stand-in is a real PyTorch device ``supa`` on host memory, with pybrml
and libsuccl.so stand-ins, so the plugin runs its ``supa`` backend as on a
card: separate pinned host and device input buffers, async scheduling, the
two-die NUMA weight layout, graphs through ``torch.supa.graph``, the KV cache
sized from ``torch.supa.mem_get_info``, collectives through SCCL.

In a session on another device (the default ``cpu`` run) this module holds
one test, which runs the module again in a nested pytest session on the
stand-in (2 cards x 2 dies, P2P) and fails with the nested failures. Run it
there directly with ``scripts/test.sh --device supa-standin
tests/e2e/test_standin.py``.

Models: the tiny Llama, SmolLM2, the tiny Qwen3-MoE and the tiny DeepSeek
V3 (MLA), each with prompts around the 128-token block, chunked prefill
(``max_num_batched_tokens`` 96) and a prefix-cache hit. float32: greedy
tokens identical to HF transformers; bfloat16 (the Llama and SmolLM2; the
cpu backend's suite covers the other two in bfloat16 and their bfloat16 ops
are the same): vLLM's ``check_logprobs_close``.
Inside the worker each test checks the backend, that weights and KV cache
are ``supa`` tensors, async scheduling, the NUMA layout on the two-die
cards and non-blocking input copies from pinned memory.

Also: FULL_AND_PIECEWISE graphs captured through ``torch.supa.graph`` equal
eager, and (slow tier) TP=2 equals TP=1 with SCCL carrying the all-reduces.
"""

from __future__ import annotations

import pytest

from tests.fixtures import standin

pytestmark = pytest.mark.e2e

if not standin.active():

    def test_on_the_standin_device(tmp_path):
        """This module's default-tier tests, in a session on the stand-in."""
        standin.run_nested(__file__, tmp_path, min_tests=7)

    @pytest.mark.slow
    def test_on_the_standin_device_slow(tmp_path):
        """This module's slow tests (tensor parallelism), on the stand-in."""
        standin.run_nested(__file__, tmp_path, min_tests=1, markers="slow")

else:
    from tests.fixtures.engine import (
        check_logprobs_close,
        counter,
        llm_engine,
        token_ids,
        vllm_logprobs,
    )
    from tests.fixtures.hf_reference import hf_greedy, hf_greedy_logprobs
    from tests.fixtures.standin import sccl_calls, supa_facts
    from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

    LENGTHS = [1, 40, 127, 128, 129, 300]
    MAX_TOKENS = 10
    NUM_LOGPROBS = 5
    CHUNKED = dict(
        max_model_len=512, max_num_batched_tokens=96, enable_chunked_prefill=True
    )

    @pytest.fixture(autouse=True)
    def _once_in_ci(request):
        """The default tier runs this module in its nested stand-in session;
        the stand-in tier (all of tests/e2e on the stand-in) does not run it
        again. Named on the command line, it runs."""
        from pathlib import Path

        named = {Path(a.split("::")[0]).resolve() for a in request.config.args}
        nested = request.config.getoption("standin_report") is not None
        if not nested and Path(__file__).resolve() not in named:
            pytest.skip("run by the default tier's nested session on the stand-in")

    def _greedy(logprobs: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
        )

    def _generate(llm, prompts, params):
        from vllm.inputs import TokensPrompt

        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)

    @pytest.fixture(scope="module")
    def models(tmp_path_factory, request):
        """name -> (checkpoint, prompts, prefix-hit prompts), built on use."""
        from transformers import AutoTokenizer

        from tests.fixtures.tiny_deepseek import build_tiny_deepseek

        built = {}

        def get(name):
            if name not in built:
                if name == "deepseek_v3":
                    path = build_tiny_deepseek("v3", tmp_path_factory.mktemp("v3"))
                else:
                    path = request.getfixturevalue(f"{name}_dir")
                tokenizer = AutoTokenizer.from_pretrained(path)
                prompts = prompt_token_ids_of_lengths(tokenizer, LENGTHS, seed=1)
                other = prompt_token_ids_of_lengths(tokenizer, [20, 30], seed=2)
                long = prompts[-1]
                hits = [long[:256] + other[0], long[:128] + other[1]]
                built[name] = (path, prompts, hits)
            return built[name]

        return get

    def _assert_runs_as_on_a_card(facts: dict) -> None:
        assert facts["backend"] == "supa"
        assert facts["torch_br"] == "0.0.0+standin"
        assert facts["device"].startswith("supa")
        assert facts["weight_devices"] == ["supa"]
        assert facts["kv_devices"] == ["supa"]
        assert facts["async_scheduling"] is True
        # The stand-in topology has two dies per card: weights are split per die.
        assert list(facts["layout"]) == ["NUMA", 2]
        assert facts["numa_layers"] > 0
        assert facts["pinned_inputs"] and facts["separate_input_buffers"]

    FAMILIES = ["tiny_llama", "smollm2", "tiny_qwen3_moe", "deepseek_v3"]

    @pytest.mark.parametrize("name", FAMILIES)
    def test_float32_identical_to_hf(name, models):
        path, prompts, hits = models(name)
        expected = hf_greedy(path, prompts + hits, MAX_TOKENS, "float32")
        with llm_engine(
            path, dtype="float32", enable_prefix_caching=True, **CHUNKED
        ) as llm:
            facts = llm.collective_rpc(supa_facts)[0]
            assert token_ids(_generate(llm, prompts, _greedy())) == expected[:-2]
            before = counter(llm, "vllm:prefix_cache_hits")
            assert token_ids(_generate(llm, hits, _greedy())) == expected[-2:]
            hit_tokens = counter(llm, "vllm:prefix_cache_hits") - before
            after = llm.collective_rpc(supa_facts)[0]
        _assert_runs_as_on_a_card(facts)
        assert hit_tokens >= 3 * 128, hit_tokens
        # Inputs went to the device as non-blocking copies from pinned memory.
        copies = after["counts"].get("copy.h2d_pinned_non_blocking", 0)
        assert copies - facts["counts"].get("copy.h2d_pinned_non_blocking", 0) > 0

    @pytest.mark.parametrize("name", ["tiny_llama", "smollm2"])
    def test_bfloat16_close_to_hf(name, models):
        path, prompts, hits = models(name)
        batch = prompts + hits
        reference = [
            (ids, steps)
            for ids, _text, steps in hf_greedy_logprobs(
                path, batch, MAX_TOKENS, NUM_LOGPROBS, "bfloat16"
            )
        ]
        with llm_engine(
            path, dtype="bfloat16", enable_prefix_caching=True, **CHUNKED
        ) as llm:
            first = vllm_logprobs(_generate(llm, prompts, _greedy(NUM_LOGPROBS)))
            second = vllm_logprobs(_generate(llm, hits, _greedy(NUM_LOGPROBS)))
            facts = llm.collective_rpc(supa_facts)[0]
        _assert_runs_as_on_a_card(facts)
        check_logprobs_close(reference, first + second)

    def test_graphs_captured_through_torch_supa_graph_equal_eager(models):
        """The supa default, VLLM_COMPILE with FULL_AND_PIECEWISE graphs,
        captured with torch.supa.graph and replayed, gives the eager tokens
        (the stand-in has no inductor code generator, so SUPACompiler runs
        the pieces eagerly, as on a card whose torch_br brings none)."""
        path, prompts, _ = models("tiny_llama")
        with llm_engine(path, dtype="float32", **CHUNKED) as llm:
            eager = token_ids(_generate(llm, prompts, _greedy()))
        graphs = dict(mode="VLLM_COMPILE", cudagraph_mode="FULL_AND_PIECEWISE")
        with llm_engine(
            path, dtype="float32", compilation_config=graphs, **CHUNKED
        ) as llm:
            before = llm.collective_rpc(supa_facts)[0]["graphs"]
            got = token_ids(_generate(llm, prompts, _greedy()))
            after = llm.collective_rpc(supa_facts)[0]["graphs"]
        assert got == eager
        assert before["captures"] > 0  # at start-up, through torch.supa.graph
        assert after["replays"] > before["replays"]  # the decode steps replayed

    @pytest.mark.slow
    def test_tensor_parallel_2_equals_1_with_sccl(models):
        """TP=2 over the two stand-in cards equals TP=1 in float32; SCCL (the
        libsuccl.so stand-in), not gloo, carries the all-reduces."""
        path, prompts, _ = models("tiny_llama")
        with llm_engine(path, dtype="float32", **CHUNKED) as llm:
            single = token_ids(_generate(llm, prompts, _greedy()))
        with llm_engine(
            path, dtype="float32", tensor_parallel_size=2, **CHUNKED
        ) as llm:
            facts = llm.collective_rpc(supa_facts)
            before = llm.collective_rpc(sccl_calls)
            got = token_ids(_generate(llm, prompts, _greedy()))
            after = llm.collective_rpc(sccl_calls)
        assert got == single
        assert [f["device"] for f in facts] == ["supa:0", "supa:1"]
        for f in facts:
            _assert_runs_as_on_a_card(f)
            # Own processes: the KV cache is sized from torch.supa.mem_get_info
            # (2 GiB cards) times --gpu-memory-utilization, not host memory.
            total = f["mem_get_info"][1]
            assert total == 2 << 30
            assert 0.8 * total < f["kv_bytes"] <= 0.92 * total
        for b, a in zip(before, after, strict=True):
            # Two all-reduces per layer per step (attention and MLP output).
            assert a["AllReduce"] - b["AllReduce"] >= 2 * 2 * MAX_TOKENS
