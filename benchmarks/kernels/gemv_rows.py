"""The cpu backend's few-row bf16 GEMM (``gemv.cpp``) against oneDNN's packed
weights (``packed_linear.py``), side by side, cold weights.

    .venv/bin/python benchmarks/kernels/gemv_rows.py [--rows 1,2,4] [--threads 2]
        [--repeats 3] [--pool-mib 256] [--json-out FILE]

For SmolLM2-135M's GEMM shapes and each row count, each path runs one call
per weight of a pool of distinct weights (at least ``--pool-mib`` MiB, so
they come from L3 or memory as in a decode step), alternating paths for
``--repeats`` rounds; it prints the median microseconds per call, the
weight bytes per second, and gemv/packed (below 1: the GEMV kernel is
faster). ``vllm_br/device/cpu_kernels/gemv.py``'s ``MAX_ROWS`` comes from
this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from shapes import SHAPES  # SmolLM2-135M's GEMMs, name -> (out, in)

from vllm_br.device.cpu_kernels import gemv


def _timed(fn, items) -> float:
    t = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - t) / len(items) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-mib", type=float, default=256.0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    if not gemv.available():
        raise SystemExit("no GEMV kernel on this host (needs AVX512-BF16)")
    torch.set_num_threads(args.threads)
    saved_max = gemv.MAX_ROWS
    gemv.MAX_ROWS = max(int(r) for r in args.rows.split(","))  # let it run
    results = []
    for name, (n, k) in SHAPES.items():
        pool = max(2, int(args.pool_mib * 2**20) // (n * k * 2))
        weights = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for _ in range(pool)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            times: dict[str, list[float]] = {"gemv": [], "packed": []}
            for _ in range(args.repeats):
                times["gemv"].append(
                    _timed(lambda w, x=x: gemv.gemv(x, w, None), weights)
                )
                times["packed"].append(
                    _timed(
                        lambda p, x=x: torch.ops.mkldnn._linear_pointwise(
                            x, p, None, "none", [], ""
                        ),
                        packed,
                    )
                )
            g, p = (statistics.median(times[key]) for key in ("gemv", "packed"))
            gbs = n * k * 2 / 1e3
            print(
                f"{name:13s} rows {rows}  gemv {g:8.1f} us ({gbs / g:5.1f} GB/s)  "
                f"packed {p:8.1f} us ({gbs / p:5.1f} GB/s)  gemv/packed = {g / p:.2f}"
            )
            results.append(
                {
                    "shape": name,
                    "rows": rows,
                    "gemv_us": g,
                    "packed_us": p,
                    "ratio": g / p,
                }
            )
    gemv.MAX_ROWS = saved_max
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
