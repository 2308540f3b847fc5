"""The ``e2e`` group: a tiny random Llama (``tiny_llama.py``, built into a
temporary folder) served by vLLM through the plugin in float32, eager,
against HF transformers' greedy ``generate`` on the host CPU in float32.

Three prompts of 7, 127 and 129 tokens run as one batch (the 127-token one
crosses the 128-token block during decoding, the 129-token one in its
prefill), 8 greedy tokens each, end-of-sequence ignored on both sides.
Identical token ids are required. The engine runs in this process (vLLM's
in-process engine core) with a small model length and a fixed 16 MiB KV
cache; the check also reads, from the worker, that the SUPA platform, its
worker and its attention backend served the run.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_br.check.base import CheckContext
from vllm_br.check.result import Outcome

LENGTHS = [7, 127, 129]
MAX_TOKENS = 8
ENGINE_ARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=512,
    kv_cache_memory_bytes=16 << 20,
    seed=0,
    use_tqdm_on_load=False,
)


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    # Only these settings apply: greedy, no end-of-sequence (as ignore_eos).
    model.generation_config = GenerationConfig(pad_token_id=pad)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=pad
    )
    out = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding
            ids = torch.tensor([p])
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def _served_by(worker) -> dict:
    """Runs in the engine's worker: what actually served."""
    from vllm.platforms import current_platform

    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    backends = {
        m.attn_backend.get_name()
        for m in model.modules()
        if getattr(m, "attn_backend", None) is not None
    }
    return {
        "platform": type(current_platform).__name__,
        "worker": type(worker).__name__,
        "attention": sorted(backends),
        "device": str(worker.device),
    }


@contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _vllm_greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        llm = LLM(model=str(path), **ENGINE_ARGS)
        try:
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
            )
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                params,
                use_tqdm=False,
            )
            facts = llm.collective_rpc(_served_by)[0]
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
    return [list(o.outputs[0].token_ids) for o in outs], facts


def _greedy_parity(ctx: CheckContext) -> Outcome:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from vllm_br.check.tiny_llama import build_tiny_llama, prompts_of_lengths

    with tempfile.TemporaryDirectory(prefix="vllm-br-check-") as d:
        t0 = time.perf_counter()
        path = build_tiny_llama(Path(d) / "tiny-llama")
        prompts = prompts_of_lengths(AutoTokenizer.from_pretrained(path), LENGTHS)
        hf = _hf_greedy(path, prompts)
        t1 = time.perf_counter()
        got, facts = _vllm_greedy(path, prompts)
        t2 = time.perf_counter()
    problems = []
    mismatched = 0
    for n, ref, ids in zip(LENGTHS, hf, got, strict=True):
        if ids != ref:
            mismatched += 1
            first = next(
                (i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                min(len(ids), len(ref)),
            )
            problems.append(
                f"{n}-token prompt differs from token {first}: vLLM {ids}, HF {ref}"
            )
    served = (
        f"{facts['platform']}, {facts['worker']}, attention "
        f"{'/'.join(facts['attention'])}, device {facts['device']}"
    )
    if facts["platform"] != "SUPAPlatform":
        problems.append(f"not served through the plugin: {served}")
    return Outcome(
        passed=not problems,
        error=float(mismatched),
        tolerance=0.0,
        metric="prompts_differing",
        shown=(
            f"{len(LENGTHS) - mismatched} of {len(LENGTHS)} prompts identical "
            f"({MAX_TOKENS} tokens), vLLM {t2 - t1:.1f} s, model + HF {t1 - t0:.1f} s"
        ),
        detail="; ".join(problems) if problems else f"served by {served}",
    )


def checks(ctx: CheckContext) -> Iterator[tuple[str, Callable[[], Outcome]]]:
    yield "greedy_vs_hf[float32]", lambda: _greedy_parity(ctx)
