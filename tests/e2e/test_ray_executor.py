"""Tensor parallelism through vLLM's Ray executor
(``distributed_executor_backend="ray"``) on a one-node Ray cluster started
here the way docs/ray.md starts a SUPA server, reached at
RAY_ADDRESS=127.0.0.1:<port>: float32 greedy tokens with TP=2 equal TP=2
through multiprocessing, each worker holds the SUPA card Ray gave it, and
the cluster's processes are gone afterwards.

The node lists its cards as ``SUPA_VISIBLE_DEVICES=3,1``: Ray's instance ids
0 and 1 are cards 3 and 1, vLLM gives local rank 0 the lower card (1, the
second visible device) and rank 1 card 3 (the first), so a worker that used
its local rank or Ray's instance id as its device fails the test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.engine import llm_engine, token_ids, worker_facts
from tests.fixtures.ray_cluster import RayHead, ray_device_facts
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

# Slow tier: a Ray cluster and two TP=2 engines (~70 s).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [3, 40]
MAX_TOKENS = 6
# Small engines: 2 cores run both engines' workers and the Ray node.
SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=2, tensor_parallel_size=2)
NODE_CARDS = "3,1"


def _greedy_tokens(llm, prompts) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return token_ids(
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    )


def test_ray_tp2_matches_mp_tp2(tiny_llama_dir, monkeypatch):
    prompts = prompt_token_ids_of_lengths(512, LENGTHS)
    env = {
        **os.environ,
        # What docs/ray.md sets for `ray start` on a SUPA server; the Ray
        # workers inherit it (and VLLM_BR_DEVICE=cpu from tests/e2e/conftest.py),
        # and import tests.fixtures.ray_cluster.ray_device_facts by name.
        "RAY_custom_unit_instance_resources": "SUPA",
        "SUPA_VISIBLE_DEVICES": NODE_CARDS,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    if "SUPA_STANDIN_TOPOLOGY" in os.environ:
        # On the stand-in the node's cards are its topology's: give it four,
        # so that cards 3 and 1 exist there as on the cpu backend's eight.
        topology = json.loads(os.environ["SUPA_STANDIN_TOPOLOGY"])
        env["SUPA_STANDIN_TOPOLOGY"] = json.dumps({**topology, "cards": 4})
    head = RayHead({"SUPA": 2}, env)  # starts while the mp engine runs
    try:
        with llm_engine(
            tiny_llama_dir, distributed_executor_backend="mp", **SMALL
        ) as llm:
            expected = _greedy_tokens(llm, prompts)

        for name, value in head.wait_ready().items():  # RAY_ADDRESS, the token
            monkeypatch.setenv(name, value)
        with llm_engine(
            tiny_llama_dir, distributed_executor_backend="ray", **SMALL
        ) as llm:
            facts = sorted(
                llm.collective_rpc(ray_device_facts), key=lambda f: f["rank"]
            )
            platforms = {f["platform"] for f in llm.collective_rpc(worker_facts)}
            got = _greedy_tokens(llm, prompts)
    finally:
        ran, left = head.stop()

    assert got == expected
    assert platforms == {"SUPAPlatform"}
    assert [f["rank"] for f in facts] == [0, 1]
    assert all(f["ray_actor"] for f in facts)
    assert len({f["node_ip"] for f in facts}) == 1  # the one node started here
    # Ray gave the two workers one card each: cards 3 and 1 of this node.
    assert sorted(c for f in facts for c in f["ray_cards"]) == [1, 3]
    assert all(len(f["ray_cards"]) == 1 for f in facts)
    assert [f["assigned"] for f in facts] == [[1, 3], [1, 3]]
    assert [f["local_rank"] for f in facts] == [0, 1]
    # Rank 0 holds card 1 (visible device 1), rank 1 card 3 (visible device 0).
    assert [f["device_index"] for f in facts] == [1, 0]

    assert {"gcs_server", "raylet"} <= set(ran), ran
    assert not left, f"Ray processes left running after the stop: {left}"
