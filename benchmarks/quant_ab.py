"""Quantized SmolLM2 against bfloat16 on the plugin, alternated in one run.

SmolLM2-135M-Instruct is quantized once with the compressed-tensors library
(``tests/fixtures/tiny_quant.py``: W8A8-INT8 and W8A16-channel, per-channel
weights, round to nearest, as llmcompressor writes them; its W8A16 preset
takes groups of 128, which SmolLM2's width 576 does not divide; the LM head,
tied to the embeddings, stays bfloat16) into
``<model cache>/SmolLM2-135M-Instruct-<scheme>``. Each round then runs every
system (``bf16`` and each scheme) in its own ``run_vllm.py`` subprocess,
W1 and W2 on one engine, in bfloat16, the order rotating per round so that
load from other jobs falls on all of them. Prints per system the median
(min-max) of W2 TPOT and W1 output tokens/s and the median of the per-round
ratios to ``bf16``, and writes everything to ``--json-out``.

Usage::

    .venv/bin/python benchmarks/quant_ab.py --rounds 5 \\
        --json-out benchmarks/results/quant_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def quantized(base: Path, scheme: str) -> Path:
    from tests.fixtures.tiny_quant import quantize_compressed_tensors

    dst = base.parent / f"{base.name}-{scheme}"
    if not (dst / "config.json").exists():
        quantize_compressed_tensors(base, dst, scheme)
    return dst


def run(model: Path, label: str, raw: Path, workloads: str) -> dict[str, dict]:
    env = dict(os.environ, VLLM_BR_DEVICE="cpu", VLLM_BR_CPU_MEMORY_GIB="6")
    out = raw / f"{label}-{{workload}}.json"
    cmd = [sys.executable, str(HERE / "run_vllm.py"), "--model", str(model),
           "--workload", workloads, "--json-out", str(out), "--label", label,
           "--dtype", "bfloat16"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return {
        w: json.loads(Path(str(out).replace("{workload}", w)).read_text())
        for w in workloads.split(",")
    }


def metric(result: dict, workload: str) -> float:
    rec = result[workload]["repeats"][0]
    return rec["tpot_s"] * 1e3 if workload == "W2" else rec["output_tokens_per_s"]


def main() -> None:
    from vllm_br.model_cache import prepare_default_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="W8A8,W8A16-channel")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", type=Path, required=True)
    args = ap.parse_args()

    base = prepare_default_model()
    systems = {"bf16": base}
    systems.update({s: quantized(base, s) for s in args.schemes.split(",")})
    workloads = args.workloads.split(",")
    names = list(systems)
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            got: dict[str, dict[str, float]] = {}
            for name in order:
                res = run(systems[name], f"{name}-r{r}", Path(tmp), args.workloads)
                got[name] = {w: metric(res, w) for w in workloads}
                print(f"round {r} {name}: {got[name]}", flush=True)
            rounds.append(got)

    summary = {}
    for w in workloads:
        unit = "TPOT ms" if w == "W2" else "output tok/s"
        print(f"\n{w} {unit}: median (min-max), median of per-round ratio to bf16")
        for name in names:
            vals = [rd[name][w] for rd in rounds]
            ratios = [rd[name][w] / rd["bf16"][w] for rd in rounds]
            summary[f"{w}/{name}"] = dict(
                median=statistics.median(vals), values=vals,
                ratio_to_bf16=statistics.median(ratios), ratios=ratios,
            )  # fmt: skip
            print(
                f"  {name:6s} {statistics.median(vals):8.2f} "
                f"({min(vals):.2f}-{max(vals):.2f})  x{statistics.median(ratios):.2f}"
            )
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(
        json.dumps(
            dict(
                command=" ".join(sys.argv),
                host=platform.processor() or platform.machine(),
                cpu=_cpu_model(),
                rounds=rounds,
                summary=summary,
            ),
            indent=2,
        )
    )


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
