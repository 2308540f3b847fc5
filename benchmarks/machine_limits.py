"""Machine limits measured with torch on the host CPU.

- bf16 GEMM peak: ``torch.matmul`` of two square bfloat16 matrices
  (n = 2048 and 4096), best of ``--repeats`` after one warm-up;
  GFLOP/s = 2 n^3 / t. (float32 is reported too, for reference.)
- memory bandwidth: ``dst.copy_(src)`` of a 1 GiB float32 tensor, best of
  ``--repeats``; GB/s = 2 x bytes / t (each byte is read once and written
  once). A read-only pass (``src.sum()``) is reported too: GB/s = bytes / t.

Threads: torch's default for this process (all cores), as HF uses.

Usage: python benchmarks/machine_limits.py --json-out limits.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402


def gemm_gflops(dtype, n: int, repeats: int) -> float:
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def bandwidth_gbs(gib: float, repeats: int) -> dict[str, float]:
    import torch

    n = int(gib * (1 << 30) // 4)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        best_read = min(best_read, time.perf_counter() - t)
    nbytes = n * 4
    return dict(
        copy_gbs=2 * nbytes / best_copy / 1e9,
        read_gbs=nbytes / best_read / 1e9,
        bytes=nbytes,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="2048,4096")
    ap.add_argument("--copy-gib", type=float, default=1.0)
    args = ap.parse_args(argv)

    import torch

    with wl.Contention() as cont:
        sizes = [int(s) for s in args.sizes.split(",")]
        bf16 = {n: gemm_gflops(torch.bfloat16, n, args.repeats) for n in sizes}
        fp32 = {n: gemm_gflops(torch.float32, n, args.repeats) for n in sizes}
        bw = bandwidth_gbs(args.copy_gib, args.repeats)
    result = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        bf16_gemm_gflops=max(bf16.values()),
        bf16_gemm_gflops_by_n={str(k): v for k, v in bf16.items()},
        fp32_gemm_gflops=max(fp32.values()),
        fp32_gemm_gflops_by_n={str(k): v for k, v in fp32.items()},
        copy_bandwidth_gbs=bw["copy_gbs"],
        read_bandwidth_gbs=bw["read_gbs"],
        copy_bytes=bw["bytes"],
        **cont.stats,
    )
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(
        f"[machine_limits] bf16 GEMM {result['bf16_gemm_gflops']:.1f} GFLOP/s, "
        f"copy {result['copy_bandwidth_gbs']:.1f} GB/s, read {result['read_bandwidth_gbs']:.1f} GB/s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
