"""Decode tokens/s of eager and every SUPA graph / compile configuration.

    .venv/bin/python benchmarks/graph_modes.py            # SmolLM2-135M, bf16
    .venv/bin/python benchmarks/graph_modes.py --quick    # tiny smoke run

All configurations are started once, side by side (one engine process each),
and measured in alternation: every round runs each configuration at each
batch size, so the machine's noise falls on all of them alike. Per batch size
``B`` (B prompts of ``--prompt-len`` tokens drawn like W1/W2, greedy,
``ignore_eos``)::

    t1 = wall time of generate(prompts, max_tokens=1)
    tN = wall time of generate(prompts, max_tokens=N)
    decode tokens/s = B * (N - 1) / (tN - t1)

Reported: the median and min-max over ``--repeats`` rounds, each
configuration's ratio to eager, whether its greedy tokens equal eager's, and
the configuration this run would choose as the default (the fastest by the
geometric mean of its ratios among those not slower than eager at any batch
size), next to the cpu backend's ``default_graph_modes``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workloads as wl  # noqa: E402

os.environ.setdefault("VLLM_BR_DEVICE", "cpu")

# name -> compilation_config (None: --enforce-eager)
CONFIGS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "compile": {"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"},
    "PIECEWISE": {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE"},
    "FULL_AND_PIECEWISE": {
        "mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
    },
    "FULL": {"mode": "VLLM_COMPILE", "cudagraph_mode": "FULL"},
    "FULL_DECODE_ONLY": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"},
}
# The same names as DeviceBackend.default_graph_modes (mode, cudagraph mode).
AS_DEFAULT = {
    "eager": ("NONE", "NONE"),
    "compile": ("VLLM_COMPILE", "NONE"),
    "PIECEWISE": ("VLLM_COMPILE", "PIECEWISE"),
    "FULL_AND_PIECEWISE": ("VLLM_COMPILE", "FULL_AND_PIECEWISE"),
    "FULL": ("VLLM_COMPILE", "FULL"),
    "FULL_DECODE_ONLY": ("NONE", "FULL_DECODE_ONLY"),
}


def _prompts(model: str, batch: int, prompt_len: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(2)
    allowed = wl.allowed_ids(wl.load_tokenizer(model))
    return [
        allowed[rng.integers(0, len(allowed), prompt_len)].tolist()
        for _ in range(batch)
    ]


def _start(name: str, args: argparse.Namespace) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batches),
        # One prefill of the largest batch fits; a small budget keeps the
        # profile run and the compile range (hence start-up) short.
        max_num_batched_tokens=max(
            args.max_model_len, max(args.batches) * args.prompt_len
        ),
        enable_prefix_caching=False,  # every round repeats the prompts
        kv_cache_memory_bytes=args.kv_cache_mib << 20,  # engines side by side
        seed=0,
    )
    config = CONFIGS[name]
    if config is None:
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = config
    t = time.perf_counter()
    llm = LLM(**kwargs)
    print(
        f"[graph_modes] {name}: started in {time.perf_counter() - t:.1f} s", flush=True
    )
    return llm


def _timed(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    t = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--json-out", default="benchmarks/results/graph_modes.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.batches, args.output_len, args.repeats = [1, 4], 8, 1
    if args.model is None:
        from vllm_br.model_cache import prepare_default_model

        args.model = str(prepare_default_model())
    names = args.configs.split(",")
    assert names[0] == "eager", "eager comes first: every ratio is to it"

    engines = {name: _start(name, args) for name in names}
    prompts = {b: _prompts(args.model, b, args.prompt_len) for b in args.batches}
    for llm in engines.values():  # warm-up: every batch shape once
        for b in args.batches:
            _timed(llm, prompts[b], min(8, args.output_len))

    rates: dict[str, dict[int, list[float]]] = {
        n: {b: [] for b in args.batches} for n in names
    }
    tokens: dict[str, dict[int, list]] = {n: {} for n in names}
    for r in range(args.repeats):
        for b in args.batches:
            for name in names:  # alternate systems within the round
                llm = engines[name]
                t1, _ = _timed(llm, prompts[b], 1)
                tn, toks = _timed(llm, prompts[b], args.output_len)
                rates[name][b].append(b * (args.output_len - 1) / max(tn - t1, 1e-9))
                tokens[name][b] = toks
        print(f"[graph_modes] round {r + 1}/{args.repeats} done", flush=True)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()

    result = _report(args, names, rates, tokens)
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[graph_modes] wrote {args.json_out}")


def _report(args, names, rates, tokens) -> dict[str, Any]:
    from vllm_br.device.cpu import CpuBackend

    med = {n: {b: statistics.median(rates[n][b]) for b in args.batches} for n in names}
    ratio = {n: {b: med[n][b] / med["eager"][b] for b in args.batches} for n in names}
    same = {
        n: all(tokens[n][b] == tokens["eager"][b] for b in args.batches) for n in names
    }
    print(
        f"\nDecode tokens/s, {Path(args.model).name} {args.dtype}, prompt {args.prompt_len}, "
        f"{args.output_len} output tokens, median (min-max) of {args.repeats}, "
        f"ratio to eager:\n"
    )
    print(
        "| config | "
        + " | ".join(f"batch {b}" for b in args.batches)
        + " | tokens = eager |"
    )
    print("|---" * (len(args.batches) + 2) + "|")
    for n in names:
        cells = [
            f"{med[n][b]:.0f} ({min(rates[n][b]):.0f}-{max(rates[n][b]):.0f}) x{ratio[n][b]:.2f}"
            for b in args.batches
        ]
        print(f"| {n} | " + " | ".join(cells) + f" | {'yes' if same[n] else 'no'} |")
    eligible = [n for n in names if all(ratio[n][b] >= 1.0 for b in args.batches)]
    chosen = max(
        eligible,
        key=lambda n: math.exp(
            statistics.fmean(math.log(ratio[n][b]) for b in args.batches)
        ),
    )
    configured = CpuBackend.default_graph_modes
    print(
        f"\nfastest not slower than eager at any batch: {chosen} "
        f"(mode, cudagraph_mode = {AS_DEFAULT[chosen]}); "
        f"CpuBackend.default_graph_modes = {configured}"
        + (" (agrees)" if tuple(configured) == AS_DEFAULT[chosen] else " (DISAGREES)")
    )
    return dict(
        date=time.strftime("%Y-%m-%d %H:%M"),
        command=" ".join(sys.argv),
        model=args.model,
        dtype=args.dtype,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        repeats=args.repeats,
        decode_tokens_per_s=rates,
        median=med,
        ratio_to_eager=ratio,
        tokens_equal_eager=same,
        chosen=chosen,
        configured_cpu_default=list(configured),
    )


if __name__ == "__main__":
    main()
