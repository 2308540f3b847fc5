"""bf16 GEMMs on the host: plain ``F.linear`` against a oneDNN-prepacked weight.

For SmolLM2-135M-Instruct's GEMM shapes (``[out, in]``: qkv 960x576, o_proj
576x576, gate_up 3072x576, down 576x1536, LM head 49152x576) and each row
count in ``--rows``, it times one call of

- ``plain``: ``F.linear(x, w)`` (what the reference ``linear`` op runs);
- ``packed[h]``: ``torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [],
  "")`` with ``p = torch.ops.mkldnn._reorder_linear_weight(w, h)``, for each
  batch-size hint ``h`` in ``--hints`` (``none``: no hint), which is what
  ``vllm_br/device/cpu_kernels/packed_linear.py`` runs,

at torch's thread count (``--threads``). Weights are cold, as in a decode
step: each path cycles through its own pool of distinct weights of the
shape, at least ``--pool-mib`` MiB of weights. Paths run one call each in a
rotating order, so that load from other jobs falls on all of them; a point's
time is the median over ``--calls`` calls per path (the fastest call is kept
too).

``max_rows[h][shape]``: the largest row count up to which ``packed[h]`` is
not slower than ``plain`` (median ratio <= 1 at it and at every smaller row
count); 0 if it loses at the first. ``max_rows_min`` is the same from the
fastest call of each path: on a shared host a two-thread call waits whenever
the other core is taken (whole scheduler slices, 4-12 ms), and where that
hits most calls only the fastest call shows the GEMM itself.

Usage: python benchmarks/kernels/packed_gemm_rows.py --json-out benchmarks/results/packed_gemm_rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from shapes import SHAPES  # SmolLM2-135M's GEMMs, name -> (out, in)


def _hint(text: str) -> int | None:
    return None if text == "none" else int(text)


def time_rotating(
    paths: dict[str, Callable[[int], object]], calls: int, pool: int
) -> dict[str, list[float]]:
    """Seconds of each call per path. One warm-up pass over the pool, then
    ``calls`` rounds of one call per path (pool entry ``round % pool``), in an
    order rotated each round so that load from other jobs falls on all."""
    for i in range(pool):  # warm-up: one pass over each pool
        for fn in paths.values():
            fn(i)
    names = list(paths)
    times: dict[str, list[float]] = {k: [] for k in names}
    for c in range(calls):
        k = c % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            paths[name](c % pool)
            times[name].append(time.perf_counter() - t)
    return times


def measure(
    out_f: int,
    in_f: int,
    rows: int,
    hints: list[int | None],
    calls: int,
    pool_mib: float,
    dtype: torch.dtype,
) -> dict[str, dict[str, float]]:
    nbytes = out_f * in_f * torch.empty((), dtype=dtype).element_size()
    pool = max(2, -(-int(pool_mib * 2**20) // nbytes))
    base = (torch.randn(out_f, in_f) * 0.05).to(dtype)
    plain = [base.clone() for _ in range(pool)]
    x = torch.randn(rows, in_f).to(dtype)
    paths = {"plain": lambda i: F.linear(x, plain[i])}
    for h in hints:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, h) for w in plain]
        paths[f"packed[{h}]"] = lambda i, p=packed: torch.ops.mkldnn._linear_pointwise(
            x, p[i], None, "none", [], ""
        )
    times = time_rotating(paths, calls, pool)
    return {
        k: dict(median_us=statistics.median(v) * 1e6, min_us=min(v) * 1e6)
        for k, v in times.items()
    }


def machine() -> dict[str, object]:
    """The host facts a GEMM timing depends on."""
    return dict(
        cpu=platform.processor() or platform.machine(),
        torch=torch.__version__,
        capability=torch.backends.cpu.get_cpu_capability(),
        amx=torch.cpu._is_amx_tile_supported(),
        avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
    )


def write_json(path: Path | None, doc: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,64,128,256,384,512,1024")
    p.add_argument("--hints", default="1,64,128,256,none")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=21, help="per path and point")
    p.add_argument("--pool-mib", type=float, default=128.0)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    hints = [_hint(h) for h in args.hints.split(",")]
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    results = []
    paths = [f"packed[{h}]" for h in hints]
    # statistic -> path -> shape -> rows
    max_rows: dict[str, dict[str, dict[str, int]]] = {
        stat: {path: {} for path in paths} for stat in ("median_us", "min_us")
    }
    print(
        f"{'shape':13} {'rows':>5} {'plain':>9} | per path: median us,"
        " median/plain, min us, min/plain"
    )
    for name, (out_f, in_f) in shapes.items():
        ok = {stat: dict.fromkeys(paths, True) for stat in max_rows}
        for rows in rows_list:
            m = measure(out_f, in_f, rows, hints, args.calls, args.pool_mib, dtype)
            line = f"{name:13} {rows:5d} {m['plain']['median_us']:9.1f}"
            for path in paths:
                for stat, table in max_rows.items():
                    ratio = m[path][stat] / m["plain"][stat]
                    m[path][f"{stat}_over_plain"] = ratio
                    ok[stat][path] = ok[stat][path] and ratio <= 1.0
                    table[path][name] = (
                        rows if ok[stat][path] else table[path].get(name, 0)
                    )
                line += (
                    f" | {path} {m[path]['median_us']:8.1f}"
                    f" {m[path]['median_us_over_plain']:4.2f}"
                    f" {m[path]['min_us']:8.1f} {m[path]['min_us_over_plain']:4.2f}"
                )
            print(line, flush=True)
            results.append(dict(shape=name, out=out_f, inp=in_f, rows=rows, **m))
    for stat, table in max_rows.items():
        print(f"packed not slower up to (rows, by {stat}):")
        for path, per_shape in table.items():
            print(f"  {path}: {per_shape}")
    doc = dict(
        command=(
            "python benchmarks/kernels/packed_gemm_rows.py"
            f" --rows {args.rows} --hints {args.hints} --shapes {args.shapes}"
            f" --dtype {args.dtype} --threads {args.threads} --calls {args.calls}"
            f" --pool-mib {args.pool_mib}"
        ),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=machine(),
        max_rows=max_rows["median_us"],
        max_rows_min=max_rows["min_us"],
        results=results,
    )
    write_json(args.json_out, doc)


if __name__ == "__main__":
    main()
