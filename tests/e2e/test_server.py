"""`vllm serve` of the default model through the plugin, on 127.0.0.1,
queried with the openai client: completions and chat, streaming and not,
/health and /metrics. The server is stopped and nothing is left running."""

from __future__ import annotations

import os

import pytest
import requests

from tests.fixtures.server import server_processes, vllm_server

pytestmark = pytest.mark.e2e

MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    # Eager: the server's API is the point here; the cpu default's compiled
    # path (~35 s of start-up with cold caches) is checked against eager in
    # tests/e2e/test_graph_modes.py.
    args = ["--served-model-name", MODEL_NAME,
            "--max-model-len", "2048", "--max-num-seqs", "8",
            "--enforce-eager"]  # fmt: skip
    with vllm_server(smollm2_dir, args, log_path) as base:
        yield base, log_path


@pytest.fixture(scope="module")
def client(server):
    import openai

    base, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def test_health_and_models(server, client):
    base, log_path = server
    assert requests.get(f"{base}/health", timeout=5).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    # The session's backend: cpu, or supa on the stand-in device.
    device = os.environ.get("VLLM_BR_DEVICE", "cpu")
    assert f"SUPA platform active on the {device} backend" in log_path.read_text()


def test_server_runs_with_secure_serialization(server):
    """The test session sets VLLM_ALLOW_INSECURE_SERIALIZATION for its own
    engines; the server and its engine processes run without it, as a
    user's do."""
    family = server_processes(server[0])
    assert len(family) >= 2  # the API server and its engine core
    for p in family:
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in p.environ(), p.cmdline()


def test_completion(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert out.choices[0].text.startswith(" Paris")
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"


def test_completion_stream_matches_non_stream(client):
    args = dict(model=MODEL_NAME, prompt="Water boils at", max_tokens=12, temperature=0)
    full = client.completions.create(**args).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**args, stream=True)]
    assert len(pieces) > 1
    assert "".join(pieces) == full


def test_chat(client, smollm2_dir):
    # The chat endpoint must apply the model's chat template (with the
    # generation prompt) and generate from it: its greedy answer equals a
    # plain completion of the templated token ids. (A 135M model's bf16 answer
    # itself is not a stable thing to assert on.)
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0
    )
    text = out.choices[0].message.content
    assert text and out.usage.completion_tokens > 0
    ids = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.usage.prompt_tokens == len(ids)
    plain = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=24, temperature=0
    )
    assert plain.choices[0].text == text


def test_chat_stream(client):
    args = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name one primary colour."}],
        max_tokens=16,
        temperature=0,
    )
    full = client.chat.completions.create(**args).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == full


def test_metrics(server, client):
    base, _ = server
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    text = requests.get(f"{base}/metrics", timeout=5).text
    assert "vllm:generation_tokens_total" in text
    assert "vllm:prefix_cache_queries" in text
