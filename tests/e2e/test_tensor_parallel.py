"""Tensor parallelism through vLLM's multiprocessing executor (spawned workers,
gloo on the cpu backend, the plugin's SUPACommunicator in every TP group):
greedy tokens in float32 equal TP=1's.

SmolLM2-135M has 9 attention heads and 3 KV heads, which vLLM cannot split in
two: it runs with TP=3 (the tiny Llama with TP=2).

Data parallelism: vLLM 0.33's offline ``LLM`` refuses ``data_parallel_size >
1``, and its offline SPMD route (``VLLM_DP_SIZE``) refuses dense models; the
last test pins both, so it fails when vLLM opens that path.
"""

from __future__ import annotations

import pytest

from tests.fixtures.engine import llm_engine, token_ids, worker_facts
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

LENGTHS = [1, 129, 40, 7]
MAX_TOKENS = 10
# Small engines: 2 cores run every worker.
SMALL = dict(dtype="float32", max_model_len=512, max_num_seqs=4)


def _prompts(name: str, model_dir) -> list[list[int]]:
    if name == "smollm2":
        from transformers import AutoTokenizer

        return prompt_token_ids_of_lengths(
            AutoTokenizer.from_pretrained(model_dir), LENGTHS
        )
    return prompt_token_ids_of_lengths(512, LENGTHS)


def _greedy_tokens(llm, prompts) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return token_ids(
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    )


def tp_facts(worker) -> dict:
    """Runs in each worker: the TP group and the communicator serving it."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    comm = group.device_communicator
    return {
        "communicator": type(comm).__name__,
        "world_size": group.world_size,
        "rank_in_group": group.rank_in_group,
        "allreduce": comm.strategy.describe(),
    }


@pytest.mark.parametrize(("name", "tp"), [("tiny_llama", 2), ("smollm2", 3)])
def test_float32_tp_matches_tp1(name, tp, request):
    model_dir = request.getfixturevalue(f"{name}_dir")
    prompts = _prompts(name, model_dir)
    with llm_engine(model_dir, **SMALL) as llm:
        expected = _greedy_tokens(llm, prompts)
    with llm_engine(
        model_dir, tensor_parallel_size=tp, distributed_executor_backend="mp", **SMALL
    ) as llm:
        facts = llm.collective_rpc(tp_facts)
        assert [f["rank_in_group"] for f in facts] == list(range(tp))
        assert {f["communicator"] for f in facts} == {"SUPACommunicator"}
        assert {f["world_size"] for f in facts} == {tp}
        assert all(f["allreduce"].startswith("SUPA allreduce: ") for f in facts)
        assert {f["platform"] for f in llm.collective_rpc(worker_facts)} == {
            "SUPAPlatform"
        }
        got = _greedy_tokens(llm, prompts)
    assert got == expected


def test_offline_data_parallel_is_refused_by_vllm(tiny_llama_dir, monkeypatch):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2\) is not supported"):
        LLM(model=str(tiny_llama_dir), data_parallel_size=2)
    monkeypatch.setenv("VLLM_DP_SIZE", "2")
    monkeypatch.setenv("VLLM_DP_RANK", "0")
    monkeypatch.setenv("VLLM_DP_MASTER_IP", "127.0.0.1")
    monkeypatch.setenv("VLLM_DP_MASTER_PORT", "29555")
    with pytest.raises(Exception, match="not supported/useful for dense models"):
        LLM(model=str(tiny_llama_dir), **SMALL)
