"""Data parallelism through `vllm serve --data-parallel-size 2` (vLLM 0.33's
offline ``LLM`` refuses DP > 1: tests/e2e/test_tensor_parallel.py pins that).

For a dense model vLLM runs each DP rank as an independent engine core on its
own SUPA device, behind one API server and vLLM's DP coordinator, which
spreads the requests. A batch of concurrent greedy float32 completions must
equal the offline DP=1 engine's output with the same engine arguments, and
both ranks must have served part of the batch (/metrics counts per engine),
each on its own device (start-up log), so the test fails if DP silently
becomes 1.

Cheap on 2 cores: one API server (``--api-server-count 1``; vLLM defaults to
one per DP rank) and each rank's worker inside its engine core
(``--distributed-executor-backend uni``; by default each engine core would
spawn one worker process).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.fixtures.engine import llm_engine, token_ids
from tests.fixtures.server import vllm_server
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

# Slow tier: two vllm serve instances, one with two engines (~70 s).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL_NAME = "tiny-llama"
LENGTHS = [1, 7, 40, 129, 3, 64, 20, 90]
MAX_TOKENS = 8
DTYPE, MAX_MODEL_LEN, MAX_NUM_SEQS = "float32", 256, 4


def _dp1_tokens(model_dir, prompts) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with llm_engine(
        model_dir, dtype=DTYPE, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS
    ) as llm:
        return token_ids(
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        )


def _per_engine(metrics: str, name: str) -> dict[str, float]:
    """Sum of a counter's samples per ``engine`` label."""
    totals: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(rf"{re.escape(name)}\{{(.*?)\}} (\S+)$", line)
        if m:
            engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
            totals[engine] = totals.get(engine, 0.0) + float(m.group(2))
    return totals


def test_dp2_server_equals_dp1(tiny_llama_dir, tmp_path):
    prompts = prompt_token_ids_of_lengths(512, LENGTHS, seed=2)
    expected = _dp1_tokens(tiny_llama_dir, prompts)

    log_path = tmp_path / "serve.log"
    args = ["--served-model-name", MODEL_NAME, "--data-parallel-size", "2",
            "--api-server-count", "1", "--distributed-executor-backend", "uni",
            "--dtype", DTYPE, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--enforce-eager"]  # fmt: skip
    with vllm_server(tiny_llama_dir, args, log_path) as base:

        def complete(prompt: list[int]) -> list[int]:
            r = requests.post(
                f"{base}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt,
                      "max_tokens": MAX_TOKENS, "temperature": 0,
                      "ignore_eos": True, "return_token_ids": True},
                timeout=120,
            )  # fmt: skip
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        served = _per_engine(
            requests.get(f"{base}/metrics", timeout=10).text,
            "vllm:request_success_total",
        )

    assert got == expected
    assert set(served) == {"0", "1"}, served
    assert sum(served.values()) == len(prompts), served
    assert all(n > 0 for n in served.values()), f"one DP rank served nothing: {served}"
    log = log_path.read_text(errors="replace")
    devices = dict(
        re.findall(r"\(EngineCore_DP(\d) pid=\d+\).*? SUPA device (\d+) ", log)
    )
    assert devices == {"0": "0", "1": "1"}, devices
