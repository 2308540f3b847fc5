"""n-gram speculative decoding against plain decoding, SmolLM2 single stream
on a repetitive workload, alternated in one run.

Workload ``W2-copy``: W2's shape (one request, greedy, ``ignore_eos``, 128
output tokens, bfloat16, the backend's default graph mode) with a prompt
that asks SmolLM2-135M-Instruct to copy a text it has been shown: two
paragraphs of ``tests/fixtures/tiny_models.CORPUS``, copied once in the
prompt, then "Copy:" again (~330 tokens). Timed as W2 is
(``benchmarks/workloads.py``): TTFT = generate(max_tokens=1), total =
generate(max_tokens=128), TPOT = (total - TTFT) / 127, prefix caching off.

Each round runs every system in its own subprocess (``plain`` and
``ngram-k<k>`` for each ``--k``), the order rotating per round. Prints per
system the median (min-max) TPOT, the median of the per-round ratios to
``plain``, and the n-gram acceptance rate read from vLLM's counters
(accepted / drafted tokens); every system's tokens must equal ``plain``'s.

Usage::

    .venv/bin/python benchmarks/spec_decode_ab.py --rounds 5 \\
        --json-out benchmarks/results/spec_decode_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

OUTPUT_LEN = 128


def prompt_text() -> str:
    from tests.fixtures.tiny_models import CORPUS

    text = "\n\n".join(CORPUS.split("\n\n")[1:3])
    return f"Copy the text.\n\nText: {text}\nCopy: {text}\n\nText: {text}\nCopy:"


def child(label: str, k: int, out: Path) -> None:
    """One system: start the engine, warm up, time W2-copy once."""
    from vllm import LLM, SamplingParams

    from vllm_br.model_cache import prepare_default_model

    kwargs: dict = dict(
        model=str(prepare_default_model()), dtype="bfloat16", max_model_len=1024,
        max_num_seqs=1, enable_prefix_caching=False, seed=0, disable_log_stats=False,
    )  # fmt: skip
    if k:
        kwargs["speculative_config"] = dict(
            method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
            prompt_lookup_min=2,
        )  # fmt: skip
    llm = LLM(**kwargs)
    prompt = prompt_text()

    def generate(max_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, list(outs[0].outputs[0].token_ids)

    generate(16)  # warm-up: the prompt's prefill and a few decode steps
    ttft, _ = generate(1)
    before = counters(llm)
    total, tokens = generate(OUTPUT_LEN)
    after = counters(llm)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    result = dict(
        system=label,
        k=k,
        prompt_tokens=len(llm.get_tokenizer().encode(prompt)),
        ttft_s=ttft,
        total_s=total,
        tpot_s=(total - ttft) / (OUTPUT_LEN - 1),
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=(accepted / drafted) if drafted else None,
        tokens=tokens,
    )
    out.write_text(json.dumps(result))


def counters(llm) -> dict[str, float]:
    names = ("num_draft_tokens", "num_accepted_tokens")
    totals = dict.fromkeys(names, 0.0)
    for m in llm.get_metrics():
        for n in names:
            if m.name == f"vllm:spec_decode_{n}":
                totals[n] += getattr(m, "value", 0)
    return totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--child", nargs=3, metavar=("LABEL", "K", "OUT"))
    args = ap.parse_args()
    if args.child:
        label, k, out = args.child
        child(label, int(k), Path(out))
        return 0

    systems = [("plain", 0)] + [(f"ngram-k{k}", k) for k in args.k]
    env = dict(os.environ, VLLM_BR_DEVICE="cpu")
    rounds = []
    for r in range(args.rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        results = {}
        for label, k in order:
            out = Path(f"/tmp/spec_decode_ab_{os.getpid()}_{label}.json")
            cmd = [sys.executable, __file__, "--child", label, str(k), str(out)]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
            results[label] = json.loads(out.read_text())
            out.unlink()
        for label, _ in systems:
            assert results[label]["tokens"] == results["plain"]["tokens"], label
        rounds.append(results)
        print(f"round {r + 1}: " + ", ".join(
            f"{k} {v['tpot_s'] * 1e3:.1f} ms" for k, v in results.items()))  # fmt: skip

    summary = {}
    for label, _ in systems:
        tpots = [rd[label]["tpot_s"] * 1e3 for rd in rounds]
        ratios = [rd[label]["tpot_s"] / rd["plain"]["tpot_s"] for rd in rounds]
        rates = [rd[label]["acceptance_rate"] for rd in rounds]
        summary[label] = dict(
            tpot_ms_median=statistics.median(tpots),
            tpot_ms_min=min(tpots),
            tpot_ms_max=max(tpots),
            ratio_to_plain_median=statistics.median(ratios),
            acceptance_rate=rates[0],
        )
        rate = "" if rates[0] is None else f", acceptance {rates[0]:.2f}"
        print(
            f"{label:10s} TPOT {summary[label]['tpot_ms_median']:.1f} ms "
            f"({min(tpots):.1f}-{max(tpots):.1f}), "
            f"x{summary[label]['ratio_to_plain_median']:.2f} of plain{rate}"
        )
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                dict(
                    host=platform.processor() or platform.machine(),
                    cpus=os.cpu_count(),
                    rounds=[
                        {k: {x: y for x, y in v.items() if x != "tokens"}
                         for k, v in rd.items()}
                        for rd in rounds
                    ],
                    summary=summary,
                ),
                indent=1,
            )
            + "\n"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
