"""Speculative decoding through the plugin: every proposer SUPA serves keeps
greedy output token for token, acceptance is real, seeded sampling is
reproducible, drafter graphs run on SUPAGraphWrapper, MTP reports its
counters on /metrics, and bad configurations stop with one sentence.

Targets, in float32: the tiny Llama (draft_model with itself as the
draft, EAGLE and EAGLE-3 heads from tests/fixtures/tiny_spec.py), the tiny
DeepSeek V3 with one MTP layer (mtp), and SmolLM2 for n-gram lookup, which
drafts only where the output repeats its context (a random tiny model does
not copy; a trained one copies text it was shown). The tiny models' batch:
a 1-token prompt and prompts of 12, 129 and 300 tokens; chunked prefill cuts
the long ones (96 tokens a step).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.fixtures.engine import counter, llm_engine, token_ids
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

# The default and stand-in tiers run every proposer's greedy equality and
# seeded sampling (n-gram on SmolLM2 on the cpu backend only); drafter graphs (an inductor compile) and MTP through
# `vllm serve` are in the slow tier, which runs on the cpu backend.

MAX_TOKENS = 24
NUM_SPEC = 3
# Chunked prefill on (vLLM's default) with a step budget the long prompts
# do not fit in.
ENGINE = dict(dtype="float32", max_num_batched_tokens=96)


def _prompts() -> list[list[int]]:
    return prompt_token_ids_of_lengths(512, [1, 129, 300, 12], seed=3)


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm, params=None) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()], params or _greedy()
    )
    return token_ids(outputs)


def _spec_counters(llm) -> dict[str, float]:
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    facts = {n: counter(llm, f"vllm:spec_decode_{n}") for n in names}
    per_pos = [
        m.values
        for m in llm.get_metrics()
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
    ]
    facts["per_pos"] = per_pos[0] if per_pos else []
    return facts


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from tests.fixtures.tiny_spec import build_tiny_deepseek_v3_mtp

    return build_tiny_deepseek_v3_mtp(tmp_path_factory.mktemp("spec") / "dsv3-mtp")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, mtp_dir):
    """Greedy tokens without speculation, per target (computed once)."""
    cache: dict[str, list[list[int]]] = {}

    def get(target: str) -> list[list[int]]:
        if target not in cache:
            model = tiny_llama_dir if target == "llama" else mtp_dir
            with llm_engine(str(model), enforce_eager=True, **ENGINE) as llm:
                cache[target] = _generate(llm)
        return cache[target]

    return get


def _speculative_config(method, tiny_llama_dir, tmp_path):
    from tests.fixtures.tiny_spec import build_tiny_eagle_head

    if method == "draft_model":
        model = tiny_llama_dir
    elif method in ("eagle", "eagle3"):
        model = build_tiny_eagle_head(tmp_path / method, tiny_llama_dir, method)
    else:
        return dict(method="mtp", num_speculative_tokens=1)
    return dict(method=method, model=str(model), num_speculative_tokens=NUM_SPEC)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp"])
def test_greedy_output_unchanged_by_speculation(
    method, tiny_llama_dir, mtp_dir, reference, tmp_path
):
    spec = _speculative_config(method, tiny_llama_dir, tmp_path)
    target = "deepseek" if method == "mtp" else "llama"
    model = mtp_dir if method == "mtp" else tiny_llama_dir
    with llm_engine(
        str(model), enforce_eager=True, speculative_config=spec, **ENGINE
    ) as llm:
        got = _generate(llm)
        facts = _spec_counters(llm)
    assert got == reference(target)
    assert facts["num_drafts"] > 0, facts
    assert facts["num_draft_tokens"] >= facts["num_drafts"], facts
    if method == "draft_model":
        # The target drafting for itself: every draft token is accepted.
        assert facts["num_accepted_tokens"] == facts["num_draft_tokens"], facts
        assert facts["per_pos"] == [facts["num_drafts"]] * NUM_SPEC, facts


# cpu tiers only: the n-gram proposer runs on the host; the stand-in tier
# runs the device-side spec-decode paths with the draft, EAGLE and MTP tests.
@pytest.mark.cpu_backend
def test_ngram_on_repetitive_text(smollm2_dir):
    """SmolLM2 asked to copy a paragraph (a 221-token prompt, prefilled in
    chunks) and a short question: n-gram lookup drafts from the prompt,
    the target confirms most drafts, and the tokens equal greedy decoding
    without speculation."""
    from tests.fixtures.tiny_models import CORPUS

    paragraph = CORPUS.split("\n\n")[1]
    prompts = [
        f"Copy the text.\n\nText: {paragraph}\nCopy: {paragraph}\nText: "
        f"{paragraph}\nCopy:",
        "What is the capital of France?",
    ]
    spec = dict(
        method="ngram", num_speculative_tokens=NUM_SPEC, prompt_lookup_max=4,
        prompt_lookup_min=2,
    )  # fmt: skip
    runs = {}
    for name, extra in (("ngram", {"speculative_config": spec}), ("plain", {})):
        with llm_engine(str(smollm2_dir), enforce_eager=True, **ENGINE, **extra) as llm:
            runs[name] = token_ids(llm.generate(prompts, _greedy()))
            if name == "ngram":
                facts = _spec_counters(llm)
    assert runs["ngram"] == runs["plain"]
    assert facts["num_draft_tokens"] >= 3 * NUM_SPEC, facts
    assert facts["num_accepted_tokens"] / facts["num_draft_tokens"] > 0.5, facts


def test_seeded_sampling_reproducible_with_speculation(tiny_llama_dir):
    """Random sampling goes through the rejection sampler's random path: a
    fresh engine given the same seed gives the same tokens, even with the
    prompts prefilled whole instead of in chunks (the generators of
    discarded prefill-chunk samples are put back); another seed gives other
    tokens. (Each seed runs on a fresh prefix cache: a later request whose
    prompt is cached drafts differently, see docs/spec_decode.md.)"""
    from vllm import SamplingParams

    spec = dict(
        method="draft_model", model=str(tiny_llama_dir), num_speculative_tokens=2
    )

    def params(seed):
        return SamplingParams(
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )  # fmt: skip

    with llm_engine(
        str(tiny_llama_dir), enforce_eager=True, speculative_config=spec, **ENGINE
    ) as llm:
        first = _generate(llm, params(7))
        facts = _spec_counters(llm)
        other = _generate(llm, params(8))
    unchunked = {**ENGINE, "max_num_batched_tokens": 2048}
    with llm_engine(
        str(tiny_llama_dir), enforce_eager=True, speculative_config=spec, **unchunked
    ) as llm:
        whole = _generate(llm, params(7))
    assert first == whole
    assert first != other
    assert 0 < facts["num_accepted_tokens"] < facts["num_draft_tokens"], facts


def drafter_graph_facts(worker) -> dict:
    """Runs in the worker: the graph wrappers and the drafter's plan."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    runner = getattr(worker, "worker", worker).model_runner
    wrappers = list(CUDAGraphWrapper._all_instances)
    return {
        "wrapper_types": sorted({type(w).__name__ for w in wrappers}),
        "drafter_piecewise_sizes": len(
            runner.drafter.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.PIECEWISE]
        ),
        "replays": sum(
            e.cudagraph.replays
            for w in wrappers
            for e in w.concrete_cudagraph_entries.values()
            if e.cudagraph is not None
        ),
    }


@pytest.mark.slow  # compiles target and head (~15-23 s): the default tier's budget
def test_eagle_drafter_graphs_on_supa_graph_wrapper(
    tiny_llama_dir, reference, tmp_path
):
    """With graphs (FULL_AND_PIECEWISE asked; vLLM serves the target's
    spec-decode batches and the drafter PIECEWISE), the drafter's pieces are
    captured by SUPAGraphWrapper and replayed; tokens are unchanged."""
    spec = _speculative_config("eagle", tiny_llama_dir, tmp_path)
    config = {
        "mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
    }
    with llm_engine(
        str(tiny_llama_dir), compilation_config=config, speculative_config=spec,
        **ENGINE,
    ) as llm:  # fmt: skip
        start = llm.collective_rpc(drafter_graph_facts)[0]
        got = _generate(llm)
        end = llm.collective_rpc(drafter_graph_facts)[0]
    assert got == reference("llama")
    assert start["wrapper_types"] == ["SUPAGraphWrapper"], start
    assert start["drafter_piecewise_sizes"] > 0, start
    assert end["replays"] > start["replays"], (start, end)


@pytest.mark.slow  # a `vllm serve` start (~22 s): the default tier's budget
def test_mtp_through_vllm_serve_reports_spec_decode_metrics(mtp_dir, tmp_path):
    import requests

    from tests.fixtures.server import metric, vllm_server

    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    args = [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--speculative-config", spec,
    ]  # fmt: skip
    with vllm_server(mtp_dir, args, tmp_path / "serve.log") as base:
        reply = requests.post(
            f"{base}/v1/completions",
            json={
                "model": str(mtp_dir), "prompt": [5, 9, 31, 7] * 8,
                "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            },
            timeout=120,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 16
        drafts = metric(base, "vllm:spec_decode_num_drafts_total")
        drafted = metric(base, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(base, "vllm:spec_decode_num_accepted_tokens_total")
        per_pos = metric(base, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    # 16 tokens: the prefill step samples the first, every later step
    # drafts one MTP token.
    assert drafts >= 8 and drafted == drafts, (drafts, drafted)
    assert accepted == per_pos and 0 <= accepted <= drafted


# ---- bad configurations -------------------------------------------------------
BAD = {
    "unknown-method": (
        dict(method="medusa2", num_speculative_tokens=2),
        r"Speculative method 'medusa2' \(--speculative-config method\) is not one "
        r"vLLM knows; on SUPA use one of ngram, draft_model, eagle, eagle3, mtp\.",
    ),
    "zero-tokens": (
        dict(method="ngram", num_speculative_tokens=0, prompt_lookup_max=3),
        r"num_speculative_tokens 0 is out of range; use 1 to 128",
    ),
    "too-many-tokens": (
        dict(method="ngram", num_speculative_tokens=129, prompt_lookup_max=3),
        r"num_speculative_tokens 129 is more than vLLM's rejection sampler takes; "
        r"use 1 to 128",
    ),
    "draft-vocab": (
        dict(method="draft_model", model="{other_vocab}", num_speculative_tokens=2),
        r"The draft model's vocabulary \(600 tokens\) differs from the target's "
        r"\(512\)",
    ),
    "mtp-without-layers": (
        dict(method="mtp", num_speculative_tokens=1),
        r"method 'mtp' found no draft for this checkpoint",
    ),
    "unserved-method": (
        dict(method="ngram_gpu", num_speculative_tokens=2, prompt_lookup_max=3),
        r"Speculative method 'ngram_gpu' \(--speculative-config method\) is not served "
        r"on SUPA; use one of ngram, draft_model, eagle, eagle3, mtp\.",
    ),
    "suffix": (
        dict(method="suffix", num_speculative_tokens=2),
        r"Speculative method 'suffix' \(--speculative-config method\) is not served "
        r"on SUPA; use one of ngram, draft_model, eagle, eagle3, mtp\.",
    ),
    "fly": (
        dict(
            method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_max=3,
            rejection_sample_method="fly",
            fly_window_size=1,
        ),
        r"rejection_sample_method 'fly' is not served on SUPA; use 'standard'\.",
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    from tests.fixtures.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("spec") / "v600", vocab_size=600)


@pytest.mark.cpu_backend
@pytest.mark.parametrize("name", list(BAD))
def test_bad_speculative_config_one_sentence(name, tiny_llama_dir, other_vocab_dir):
    """Each stops at start-up; the sentence is what `vllm serve` prints
    (the CLI hook's user_error_sentence), naming the setting."""
    from vllm import LLM

    from vllm_br.patches import user_error_sentence

    spec, expected = BAD[name]
    spec = {
        k: v.format(other_vocab=other_vocab_dir) if isinstance(v, str) else v
        for k, v in spec.items()
    }
    with pytest.raises(Exception) as err:  # noqa: B017 (vLLM's own types vary)
        LLM(
            model=str(tiny_llama_dir), speculative_config=spec, enforce_eager=True,
            **ENGINE,
        )  # fmt: skip
    sentence = user_error_sentence(err.value)
    assert sentence is not None, repr(err.value)
    assert re.search(expected, sentence), sentence
    assert sentence.endswith(".") and not re.search(r"\.\s+[A-Z]", sentence[:-1])
