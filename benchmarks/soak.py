"""Soak: a long mixed streaming load against `vllm serve`, watching for leaks.

Starts `vllm serve` of a model (default: the default model, SmolLM2) on
127.0.0.1 with an API key, keeps ``--concurrency`` streaming clients busy
for ``--minutes`` (completions and chat alternating, random prompt and
output lengths, one in ten dropped after a few chunks), and once a second
samples the resident memory of every process of the server (API server,
engine core, workers) and vLLM's KV-cache usage from /metrics.

Writes ``<out>.json`` (per-second samples, per-minute throughput, errors,
memory growth from minute 2 to the end per process) and prints the summary.
Plot it with ``benchmarks/soak_plot.py <out>.json <out>.png``. Not a test.

Usage (2-core hosts: nothing else running):
    .venv/bin/python benchmarks/soak.py --minutes 10 --concurrency 8 \
        --out benchmarks/results/soak-<host>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "soak-model"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gauge(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{.*?\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


class Sampler(threading.Thread):
    """Once a second: RSS (MiB) of each process in the server's tree, keyed
    by its role, and the KV-cache usage."""

    def __init__(self, pid: int, base: str):
        super().__init__(daemon=True)
        self.pid, self.base, self.samples, self.stop = pid, base, [], threading.Event()

    def run(self) -> None:
        import psutil
        import requests

        root = psutil.Process(self.pid)
        t0 = time.time()
        while not self.stop.is_set():
            rss = {}
            try:
                for p in [root, *root.children(recursive=True)]:
                    role = "api_server" if p.pid == root.pid else p.name()
                    rss[f"{role}:{p.pid}"] = p.memory_info().rss / 2**20
                kv = _gauge(
                    requests.get(f"{self.base}/metrics", timeout=5).text,
                    "vllm:kv_cache_usage_perc",
                )
            except Exception:  # noqa: BLE001 - a sample lost, not the run
                time.sleep(1)
                continue
            self.samples.append({"t": time.time() - t0, "rss_mib": rss, "kv_usage": kv})
            self.stop.wait(1.0)


async def _client(base, i, deadline, rng, stats, tokenizer_words):
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=120, headers=AUTH) as client:
        n = 0
        while time.time() < deadline:
            n += 1
            chat = (i + n) % 2 == 1
            max_tokens = rng.randint(16, 128)
            words = " ".join(
                rng.choice(tokenizer_words) for _ in range(rng.randint(5, 200))
            )
            drop = rng.random() < 0.1
            body = {"model": NAME, "max_tokens": max_tokens, "temperature": 0.7,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            if chat:
                body["messages"] = [{"role": "user", "content": words}]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = words
                path = "/v1/completions"
            start = time.time()
            try:
                chunks, tokens = 0, 0
                async with client.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append((start, f"HTTP {r.status_code}"))
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunks += 1
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if drop and chunks == 3:
                            break
                if drop:
                    stats["dropped"] += 1
                else:
                    stats["done"].append((time.time(), tokens))
            except Exception as e:  # noqa: BLE001 - counted, the load goes on
                stats["errors"].append((start, f"{type(e).__name__}: {e}"[:200]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="model folder (default: the default model)"
    )
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", required=True, help="output path without extension")
    ap.add_argument("serve_args", nargs="*", help="extra `vllm serve` arguments")
    args = ap.parse_args()

    model = args.model or subprocess.run(
        [sys.executable, "-m", "vllm_br.model_cache", "path"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.with_suffix(".serve.log"), "w")
    vllm = str(Path(sys.executable).with_name("vllm"))
    cmd = [vllm, "serve", model, "--served-model-name", NAME, "--host", "127.0.0.1",
           "--port", str(port), "--api-key", KEY, "--max-model-len", "2048",
           *args.serve_args]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_ALLOW_INSECURE_SERIALIZATION"
    }
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    import requests

    try:
        t_start = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited; see {log.name}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        startup_s = time.time() - t_start
        sampler = Sampler(proc.pid, base)
        sampler.start()
        stats = {"done": [], "errors": [], "dropped": 0}
        words = "the a model card token stream memory graph block cache device".split()
        t0 = time.time()
        deadline = t0 + args.minutes * 60

        async def load():
            await asyncio.gather(
                *(
                    _client(base, i, deadline, random.Random(i), stats, words)
                    for i in range(args.concurrency)
                )
            )

        asyncio.run(load())
        sampler.stop.set()
        sampler.join()
        # The last streams wind down: KV usage must come back to 0.
        for _ in range(30):
            metrics = requests.get(f"{base}/metrics", timeout=5).text
            idle_kv = _gauge(metrics, "vllm:kv_cache_usage_perc")
            if idle_kv == 0:
                break
            time.sleep(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    minutes = int(args.minutes + 0.999)
    per_minute = [
        {
            "minute": m + 1,
            "requests": sum(
                1 for t, _ in stats["done"] if m * 60 <= t - t0 < (m + 1) * 60
            ),
            "tokens": sum(
                k for t, k in stats["done"] if m * 60 <= t - t0 < (m + 1) * 60
            ),
            "errors": sum(
                1 for t, _ in stats["errors"] if m * 60 <= t - t0 < (m + 1) * 60
            ),
        }
        for m in range(minutes)
    ]
    samples = sampler.samples
    growth = {}
    for key in sorted({k for s in samples for k in s["rss_mib"]}):
        series = [(s["t"], s["rss_mib"][key]) for s in samples if key in s["rss_mib"]]
        at2 = [v for t, v in series if 60 <= t < 120]
        end = [v for t, v in series if t >= series[-1][0] - 60]
        if at2 and end:
            growth[key] = {
                "minute_2_mib": round(sum(at2) / len(at2), 1),
                "last_minute_mib": round(sum(end) / len(end), 1),
                "growth_mib": round(sum(end) / len(end) - sum(at2) / len(at2), 1),
            }
    report = {
        "command": " ".join(sys.argv),
        "serve": " ".join(cmd[1:]),
        "host": _host(),
        "startup_s": round(startup_s, 1),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "completed": len(stats["done"]),
        "dropped_on_purpose": stats["dropped"],
        "errors": len(stats["errors"]),
        "error_samples": [e for _, e in stats["errors"][:10]],
        "kv_usage_after": idle_kv,
        "per_minute": per_minute,
        "memory_growth": growth,
        "samples": samples,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    return 0


def _host() -> str:
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.fixtures.time_budget import host_kind

        return host_kind()[0]
    except Exception:  # noqa: BLE001 - run outside the repository root
        import platform

        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
