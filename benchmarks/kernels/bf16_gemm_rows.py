"""Few-row bf16 GEMMs on the host: native bf16 weight against its float32 copy.

For SmolLM2-135M-Instruct's GEMM shapes (``[out, in]``: qkv 960x576, o_proj
576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) and each row
count in ``--rows``, it times one call of

- ``native``: ``F.linear(x_bf16, w_bf16)``;
- ``fp32``: ``F.linear(x_bf16.float(), w_fp32).to(bf16)`` (what the cpu
  backend does with its float32 weight copies: input cast up, output rounded
  to bf16),

at each torch thread count in ``--threads``.

Weights are cold by default, as in a decode step: the model's weights
(212 MiB in bf16) do not fit in the last-level cache, so each GEMM streams its
weight from memory. Each path cycles through its own pool of distinct weights
of the shape, at least ``--pool-mib`` MiB of float32 (``--hot``: one weight,
reused, cache-resident where it fits). Calls alternate native / fp32, one call
each, so that load from other jobs falls on both; a point's time is the
median over ``--calls`` calls per path (min and max are kept too).

``crossover_rows`` per thread count and shape: the largest row count up to
which native is not slower (median native/fp32 <= 1 at it and every smaller
row count), 0 if native loses already at 1 row. ``crossover_rows_min`` is the
same from the fastest call of each path: on a shared host a two-thread call
waits whenever the other core is taken (whole scheduler slices, 4-12 ms), and
where that hits most calls only the fastest call shows the GEMM itself.

Usage: python benchmarks/kernels/bf16_gemm_rows.py --json-out benchmarks/results/bf16_gemm_rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from shapes import SHAPES  # SmolLM2-135M's GEMMs, name -> (out, in)


def measure(
    out_f: int, in_f: int, rows: int, calls: int, pool_mib: float, hot: bool
) -> dict[str, float]:
    fp32_bytes = out_f * in_f * 4
    pool = 1 if hot else max(2, -(-int(pool_mib * 2**20) // fp32_bytes))
    base = (torch.randn(out_f, in_f) * 0.05).to(torch.bfloat16)
    w16 = [base.clone() for _ in range(pool)]
    w32 = [base.float() for _ in range(pool)]
    x = torch.randn(rows, in_f).to(torch.bfloat16)
    paths = {
        "native": lambda i: F.linear(x, w16[i]),
        "fp32": lambda i: F.linear(x.float(), w32[i]).to(torch.bfloat16),
    }
    for i in range(pool):  # warm-up: one pass over each pool
        for fn in paths.values():
            fn(i)
    times: dict[str, list[float]] = {"native": [], "fp32": []}
    for c in range(calls):
        order = ("native", "fp32") if c % 2 == 0 else ("fp32", "native")
        for name in order:
            t = time.perf_counter()
            paths[name](c % pool)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        pool=pool,
        calls=calls,
        native_us=med["native"] * 1e6,
        fp32_us=med["fp32"] * 1e6,
        native_min_us=min(times["native"]) * 1e6,
        native_max_us=max(times["native"]) * 1e6,
        fp32_min_us=min(times["fp32"]) * 1e6,
        fp32_max_us=max(times["fp32"]) * 1e6,
        native_over_fp32=med["native"] / med["fp32"],
        min_native_over_fp32=min(times["native"]) / min(times["fp32"]),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,6,8,16,32")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--calls", type=int, default=41, help="per path and point")
    p.add_argument("--pool-mib", type=float, default=256.0)
    p.add_argument("--hot", action="store_true")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    results = []
    crossover: dict[str, dict[str, int]] = {}
    crossover_min: dict[str, dict[str, int]] = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"\n== torch threads {threads}, {'hot' if args.hot else 'cold'} weights")
        print(
            f"{'shape':14} {'rows':>4} {'native us':>10} {'fp32 us':>10} {'n/f':>6}"
            f" {'min native':>10} {'min fp32':>10} {'n/f':>6}"
        )
        for name, (out_f, in_f) in shapes.items():
            cross, ok, cross_min, ok_min = 0, True, 0, True
            for rows in rows_list:
                m = measure(out_f, in_f, rows, args.calls, args.pool_mib, args.hot)
                m.update(shape=name, out=out_f, inp=in_f, rows=rows, threads=threads)
                results.append(m)
                ok = ok and m["native_over_fp32"] <= 1.0
                ok_min = ok_min and m["min_native_over_fp32"] <= 1.0
                cross = rows if ok else cross
                cross_min = rows if ok_min else cross_min
                print(
                    f"{name:14} {rows:4d} {m['native_us']:10.1f} {m['fp32_us']:10.1f}"
                    f" {m['native_over_fp32']:6.2f} {m['native_min_us']:10.1f}"
                    f" {m['fp32_min_us']:10.1f} {m['min_native_over_fp32']:6.2f}",
                    flush=True,
                )
            crossover.setdefault(str(threads), {})[name] = cross
            crossover_min.setdefault(str(threads), {})[name] = cross_min
        print(f"crossover_rows: {crossover[str(threads)]}")
        print(f"crossover_rows_min: {crossover_min[str(threads)]}")
    doc = dict(
        command=(
            "python benchmarks/kernels/bf16_gemm_rows.py"
            f" --rows {args.rows} --threads {args.threads} --shapes {args.shapes}"
            f" --calls {args.calls} --pool-mib {args.pool_mib}"
            + (" --hot" if args.hot else "")
        ),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=dict(
            cpu=platform.processor() or platform.machine(),
            torch=torch.__version__,
            capability=torch.backends.cpu.get_cpu_capability(),
        ),
        weights="hot" if args.hot else "cold",
        crossover_rows=crossover,
        crossover_rows_min=crossover_min,
        results=results,
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
