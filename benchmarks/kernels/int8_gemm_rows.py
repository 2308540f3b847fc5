"""int8 GEMMs on the host against the bf16 GEMM, per row count.

For SmolLM2-135M's layer GEMM shapes (``shapes.LAYER_SHAPES``) and each row
count in ``--rows``, it times one call of

- ``bf16_packed``: the bf16 GEMM on a oneDNN-prepacked weight (what the cpu
  backend runs for unquantized bf16 layers on hosts with fast bf16,
  ``packed_linear``); only on those hosts;
- ``bf16_plain``: ``F.linear`` on the bf16 weight (what the backend runs for
  a few rows on hosts without fast bf16, ``bf16_gemm``);
- ``w8a16_gemv``: the C++ W8A16 GEMV (``int8_gemv.cpp``; up to 4 rows);
- ``w8a8``: the W8A8 path of ``vllm_br/device/cpu_kernels/int8_gemm.py``:
  per-token int8 quantization of the activations (the ``quantize_int8``
  reference) and its exact int32 GEMM (the C++ GEMV up to 4 rows, else
  ``torch._int_mm`` with VNNI or float32 GEMMs over K slices) with the scales;
- ``w8a16_int8pack``: ``torch.ops.aten._weight_int8pack_mm`` (bf16
  activations, int8 weight, per-channel scales);
- ``w8a16_dequant``: the weight dequantized to bf16 and ``F.linear`` (the
  ``weight_only_linear`` reference, and the kernel above its row threshold).

Weights are cold, as in a decode step: each path cycles through its own pool
of distinct weights of the shape (at least ``--pool-mib`` MiB). Paths run one
call each in a rotating order; a point's time is the median over
``--calls`` calls, printed as a ratio to the bf16 GEMM the backend runs
(``bf16_packed`` where the host has fast bf16, else ``bf16_plain``).

Usage: .venv/bin/python benchmarks/kernels/int8_gemm_rows.py --json-out benchmarks/results/int8_gemm_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import LAYER_SHAPES, SHAPES  # noqa: E402

from vllm_br.device.cpu_kernels import int8_gemm, int8_gemv, packed_linear  # noqa: E402
from vllm_br.ops.quant import quantize_int8  # noqa: E402


def paths(n: int, k: int, pool: int, x_rows: int):
    g = torch.Generator().manual_seed(0)
    wf = [torch.randn(n, k, generator=g).bfloat16() for _ in range(pool)]
    has_packed = packed_linear.host_supported()
    packed = (
        [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in wf]
        if has_packed
        else []
    )
    wq = [
        torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        for _ in range(pool)
    ]
    s = torch.rand(n, generator=g) / 100
    sb = s.bfloat16()
    i = {"n": 0}

    def nxt(lst):
        i["n"] = (i["n"] + 1) % pool
        return lst[i["n"]]

    def w8a8(x):
        q, xs, _ = quantize_int8(x)
        acc = int8_gemm._int8_mm(q, nxt(wq))
        return (acc.float() * xs * s).bfloat16()

    fns = {}
    if has_packed:
        fns["bf16_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, nxt(packed), None, "none", [], ""
        )
    fns["bf16_plain"] = lambda x: F.linear(x, nxt(wf))
    if x_rows <= int8_gemv.max_rows():
        fns["w8a16_gemv"] = lambda x: int8_gemv.w8_bf16(x, nxt(wq), s, None)
    return fns | {
        "w8a8": w8a8,
        "w8a16_int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, nxt(wq), sb),
        "w8a16_dequant": lambda x: F.linear(
            x, (nxt(wq).float() * s[:, None]).bfloat16()
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,128")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--pool-mib", type=int, default=64)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    result = {"threads": torch.get_num_threads(), "points": {}}
    for name in LAYER_SHAPES:
        n, k = SHAPES[name]
        pool = max(2, (args.pool_mib << 20) // (n * k * 2))
        for m in rows:
            fns = paths(n, k, pool, m)
            x = torch.randn(m, k).bfloat16()
            times = {p: [] for p in fns}
            order = list(fns)
            for c in range(args.calls + 2):
                for p in order[c % len(order) :] + order[: c % len(order)]:
                    t0 = time.perf_counter()
                    fns[p](x)
                    if c >= 2:
                        times[p].append(time.perf_counter() - t0)
            med = {p: statistics.median(v) * 1e6 for p, v in times.items()}
            result["points"][f"{name}/{m}"] = med
            base_name = "bf16_packed" if "bf16_packed" in med else "bf16_plain"
            base = med[base_name]
            print(
                f"{name:13s} rows {m:4d}  {base_name} {base:7.1f} us  "
                + "  ".join(
                    f"{p} x{v / base:.2f}" for p, v in med.items() if p != base_name
                ),
                flush=True,
            )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
