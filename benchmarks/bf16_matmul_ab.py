"""VLLM_BR_CPU_BF16_MATMUL settings compared inside one plugin engine.

The setting is read by each GEMM when it runs (``vllm_br.device.cpu_kernels.bf16_gemm``), so one
engine (one start-up, one compiled graph) can serve a workload under each
setting in turn: ``LLM.collective_rpc`` sets the variable in the worker
before every generate. Settings alternate within each round (the first one
rotates per round), so load from other jobs on a shared host falls on all of
them alike. W1 and W2 are measured as ``run_vllm.py`` measures them (W2:
TPOT = (generate(128) - generate(1)) / 127; W1: output tokens/s of one
generate of the 64 requests), on the same engine arguments
(``--max-num-batched-tokens`` as given).

Prints per setting the median (min-max) over the rounds and the median of
the per-round ratios to the first setting, checks that greedy tokens agree
across settings, and writes everything to ``--json-out``.

Usage::

    VLLM_BR_DEVICE=cpu VLLM_BR_CPU_MEMORY_GIB=6 .venv/bin/python benchmarks/bf16_matmul_ab.py \\
        --model ~/.cache/vllm-br/models/SmolLM2-135M-Instruct --workload W2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
VAR = "VLLM_BR_CPU_BF16_MATMUL"


def rpc_set_mode(worker: Any, mode: str) -> str:
    os.environ[VAR] = mode
    return os.environ[VAR]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=["W1", "W2"], required=True)
    ap.add_argument("--modes", default="fp32,auto", help="first: the baseline")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = wl.build(args.workload, args.model)
    longest = max(len(p) + work.output_len for p in work.prompts)
    kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=wl.DTYPE,
        max_model_len=-(-longest // 128) * 128,
        max_num_seqs=len(work.prompts),
        enable_prefix_caching=False,
        seed=0,
    )
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(**kwargs)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]

    def generate(max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    for mode in modes:  # warm-up under every setting
        llm.collective_rpc(rpc_set_mode, args=(mode,))
        generate(8)

    metric = "tpot_ms" if work.name == "W2" else "output_tok_s"
    samples: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    rounds = []
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        rec: dict[str, Any] = {"order": order}
        for mode in order:
            assert llm.collective_rpc(rpc_set_mode, args=(mode,))[0] == mode
            with wl.Contention() as cont:
                if work.name == "W2":
                    ttft, _ = generate(1)
                    total, toks = generate(work.output_len)
                    value = (total - ttft) / (work.output_len - 1) * 1e3
                else:
                    total, toks = generate(work.output_len)
                    value = work.output_tokens / total
            samples[mode].append(value)
            tokens.setdefault(mode, toks)
            rec[mode] = dict(value=value, **cont.stats)
            print(f"round {r + 1} {mode}: {metric} {value:.2f}", flush=True)
        rounds.append(rec)

    base = modes[0]
    summary = {}
    for mode in modes:
        ratios = [s / b for s, b in zip(samples[mode], samples[base], strict=True)]
        summary[mode] = dict(
            median=statistics.median(samples[mode]),
            min=min(samples[mode]),
            max=max(samples[mode]),
            median_ratio_to_base=statistics.median(ratios),
            tokens_equal_base=tokens[mode] == tokens[base],
        )
        s = summary[mode]
        print(
            f"{work.name} {mode}: {metric} median {s['median']:.2f}"
            f" ({s['min']:.2f}-{s['max']:.2f}), per-round ratio to {base}"
            f" {s['median_ratio_to_base']:.3f}, tokens equal {s['tokens_equal_base']}"
        )
    if args.json_out:
        doc = dict(
            command=" ".join(sys.argv),
            date=time.strftime("%Y-%m-%d %H:%M"),
            workload=work.name,
            metric=metric,
            engine_kwargs=kwargs,
            summary=summary,
            rounds=rounds,
        )
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
