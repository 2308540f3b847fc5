"""What a serving user meets every day, against one `vllm serve` of the tiny
Llama on 127.0.0.1 (float32, eager, an API key, a KV cache of 40 blocks):

- 64 concurrent streams, completions and chat alternating: each ends once,
  with its finish reason and exactly ``max_tokens`` tokens;
- clients that drop the stream after a few chunks and requests abandoned by
  a client timeout: afterwards nothing runs or waits and every KV block is
  free again (the engine's own gauges on /metrics);
- more load than the KV cache holds: requests are preempted and recomputed,
  and their greedy tokens equal an unpressured run's;
- malformed requests: each a 4xx with a message, and the server keeps
  serving;
- the API key: 401 without it on every /v1 route, as vLLM guards them;
- the engine-core process killed mid-stream: the client gets an error, not a
  hang, the server goes within 30 s and no process is left (last: it ends the
  server).

Request handling is vLLM's engine and API server over the plugin, the same
on every backend, so the stand-in tier skips the module (``cpu_backend``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import psutil
import pytest
import requests

from tests.fixtures.server import metric, server_processes, vllm_server

pytestmark = [pytest.mark.e2e, pytest.mark.cpu_backend]

MODEL = "tiny-llama"
KEY = "test-key-robustness"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
KV_BLOCKS = 40  # of 128 tokens; the preemption test needs more than this


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("robust") / "serve.log"
    args = ["--served-model-name", MODEL, "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
            "--num-gpu-blocks-override", str(KV_BLOCKS), "--enforce-eager",
            "--api-key", KEY]  # fmt: skip
    with vllm_server(tiny_llama_dir, args, log_path) as base:
        yield base


def _idle(base: str, timeout_s: float = 30) -> dict[str, float]:
    """Wait until nothing runs or waits and the KV cache is empty; the
    gauges as last read."""
    deadline = time.time() + timeout_s
    while True:
        gauges = {
            name: metric(base, name)
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        }
        if all(v == 0 for v in gauges.values()) or time.time() > deadline:
            return gauges
        time.sleep(0.5)


async def _stream(client, i: int, max_tokens: int) -> dict:
    """One streaming request (completion for even i, chat for odd): its ids,
    finish reasons, usage and whether it ended with [DONE]."""
    chat = i % 2 == 1
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": f"Stream {i}: tell a story."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"Stream {i}: once upon a time"
        path = "/v1/completions"
    out = {"ids": set(), "finish": [], "usage": None, "done": False}
    async with client.stream("POST", path, json=body, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out["done"] = True
                continue
            chunk = json.loads(data)
            out["ids"].add(chunk["id"])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                if choice.get("finish_reason"):
                    out["finish"].append(choice["finish_reason"])
    return out


def test_64_concurrent_streams_each_end_once_with_max_tokens(server):
    import httpx

    max_tokens = 16
    before = metric(server, "vllm:request_success_total")

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            return await asyncio.gather(
                *(_stream(client, i, max_tokens) for i in range(64))
            )

    results = asyncio.run(run())
    for i, res in enumerate(results):
        assert res["done"], f"stream {i} did not end with [DONE]"
        assert res["finish"] == ["length"], (i, res["finish"])
        assert res["usage"]["completion_tokens"] == max_tokens, (i, res["usage"])
        assert len(res["ids"]) == 1, (i, res["ids"])
    ids = [next(iter(r["ids"])) for r in results]
    assert len(set(ids)) == 64  # no request answered twice
    assert metric(server, "vllm:request_success_total") - before == 64


def test_dropped_streams_and_abandoned_requests_free_every_kv_block(server):
    import httpx

    before = metric(server, "vllm:request_success_total")

    async def drop_after_chunks(client, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Dropped {i}:", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        seen = 0
        async with client.stream(
            "POST", "/v1/completions", json=body, headers=AUTH
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection
        return seen

    async def abandon(client, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Abandoned {i}:", "max_tokens": 400,
                "ignore_eos": True}  # fmt: skip
        try:
            await client.post("/v1/completions", json=body, headers=AUTH, timeout=0.5)
        except httpx.TimeoutException:
            return True
        return False

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            drops = asyncio.gather(*(drop_after_chunks(client, i) for i in range(16)))
            abandons = asyncio.gather(*(abandon(client, i) for i in range(8)))
            return await drops, await abandons

    seen, abandoned = asyncio.run(run())
    assert seen == [3] * 16
    gauges = _idle(server)
    assert gauges == {
        "vllm:num_requests_running": 0,
        "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0,
    }
    # Aborted, not run to their 400 tokens: none of them finished.
    assert metric(server, "vllm:request_success_total") == before
    # And the server serves the next request in full.
    r = requests.post(
        f"{server}/v1/completions", headers=AUTH, timeout=60,
        json={"model": MODEL, "prompt": "After", "max_tokens": 5, "ignore_eos": True},
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def _greedy(base: str, prompt: list[int], max_tokens: int) -> list[int]:
    r = requests.post(
        f"{base}/v1/completions", headers=AUTH, timeout=300,
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
              "temperature": 0, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_preempted_requests_recompute_the_same_greedy_tokens(server):
    """16 requests that grow to 3 blocks each (48 > the cache's 40): vLLM
    preempts and recomputes; the tokens equal those of the same requests
    served 4 at a time (12 blocks, no preemption)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

    prompts = prompt_token_ids_of_lengths(512, [100] * 16, seed=7)
    max_tokens = 180  # 100 + 180 tokens: 3 blocks of 128

    preempted = metric(server, "vllm:num_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        calm = list(pool.map(lambda p: _greedy(server, p, max_tokens), prompts))
    assert metric(server, "vllm:num_preemptions_total") == preempted, "not unpressured"

    with ThreadPoolExecutor(16) as pool:
        pressed = list(pool.map(lambda p: _greedy(server, p, max_tokens), prompts))
    assert metric(server, "vllm:num_preemptions_total") > preempted, "no preemption"
    assert pressed == calm
    assert _idle(server)["vllm:kv_cache_usage_perc"] == 0


# name -> (path, JSON body, or raw text for invalid JSON)
MALFORMED = {
    "negative max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    "zero max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    "prompt beyond max_model_len": (
        "/v1/completions",
        {"prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 4},
    ),
    "unknown model": ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    "invalid JSON": ("/v1/completions", '{"model": "tiny-llama", "prompt": '),
    "out-of-vocabulary token id": (
        "/v1/completions",
        {"prompt": [1, 2, 10**6], "max_tokens": 4},
    ),
    "logprobs above the limit": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "logprobs": 1000},
    ),
    "negative temperature": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "temperature": -1},
    ),
    "top_p above 1": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 4, "top_p": 1.5},
    ),
    "empty chat": ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_request_gets_4xx_with_message_and_server_serves_on(server, name):
    path, body = MALFORMED[name]
    if isinstance(body, str):
        r = requests.post(
            f"{server}{path}", data=body, timeout=30,
            headers={**AUTH, "Content-Type": "application/json"},
        )  # fmt: skip
    else:
        r = requests.post(
            f"{server}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=30
        )
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:500])
    error = r.json().get("error", r.json())
    message = error.get("message") if isinstance(error, dict) else error
    assert message, (name, r.text[:500])
    assert len(_greedy(server, [1, 2, 3], 3)) == 3


def test_api_key_guards_every_v1_route(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
    }
    for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        assert (
            requests.post(f"{server}{path}", json=payload, timeout=30).status_code
            == 401
        )
        wrong = {"Authorization": "Bearer not-the-key"}
        r = requests.post(f"{server}{path}", json=payload, headers=wrong, timeout=30)
        assert r.status_code == 401
        r = requests.post(f"{server}{path}", json=payload, headers=AUTH, timeout=60)
        assert r.status_code == 200
    assert requests.get(f"{server}/v1/models", timeout=10).status_code == 401
    assert (
        requests.get(f"{server}/v1/models", headers=AUTH, timeout=10).status_code == 200
    )
    # vLLM guards /v1 (and /v2, /inference, /cohere) only: /health and
    # /metrics answer without the key, for probes and Prometheus.
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    assert requests.get(f"{server}/metrics", timeout=10).status_code == 200


def test_killed_engine_core_ends_streams_and_the_server(server):
    """Last in the module: it ends the server."""
    import httpx

    family = server_processes(server)
    api = family[0]
    (core,) = [p for p in family if "EngineCore" in " ".join(p.cmdline() + [p.name()])]

    async def stream_until_error() -> str:
        body = {"model": MODEL, "prompt": "Killed:", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with httpx.AsyncClient(base_url=server, timeout=30) as client:
            try:
                async with client.stream(
                    "POST", "/v1/completions", json=body, headers=AUTH
                ) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            seen += 1
                            if seen == 3:
                                core.send_signal(signal.SIGKILL)
                            if '"error"' in line:
                                return "error event"
                            if line == "data: [DONE]":
                                return "finished"
            except (httpx.HTTPError, httpx.StreamError) as e:
                return f"transport error: {type(e).__name__}"
        return "ended without [DONE]"

    start = time.time()
    outcome = asyncio.run(stream_until_error())
    assert outcome != "finished", "a stream whose engine died finished normally"
    assert time.time() - start < 35, "the client hung"
    # The server reports unhealthy or exits within 30 s.
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if requests.get(f"{server}/health", timeout=2).status_code != 200:
                break
        except requests.ConnectionError:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the server stayed healthy for 30 s without its engine core")
    # Nothing of it is left once it has gone (the fixture stops it if the
    # API process is still there; it must not leave the workers behind).
    _, alive = psutil.wait_procs([p for p in family if p.pid != api.pid], timeout=30)
    assert alive == [], alive
