"""How much a decode GEMM could gain by overlapping its compute with its
weight stream.

For SmolLM2-135M-Instruct's GEMM shapes at ``--rows`` rows (64: W1's decode
batch), at ``--threads`` threads, it times one call of

- ``hot``: the GEMM the plugin's cpu backend runs at that row count on this
  host, on one weight over and over, so the weight is in cache: the compute
  alone. On a host with fast bf16 (AVX512-BF16 or AMX) that is the
  oneDNN-packed GEMM (``packed_linear``, path ``packed_bf16``); without it,
  the float32 weight copy (path ``fp32_copy``) or, at few rows, the plain
  bf16 weight (``plain_bf16``), as ``vllm_br.device.cpu_kernels.bf16_gemm.use_fp32_copy``
  decides;
- ``cold``: the same GEMM cycling through a pool of distinct weights of at
  least ``--pool-mib`` MiB (beyond what this host's L3 keeps), as in a
  decode step, where each layer's weights come from memory;
- ``read``: a plain read (``sum`` over a float32 view) of the same number of
  cold bytes: the weight stream alone.

A kernel that overlapped compute and stream perfectly would take
``max(hot, read)``; one that does them one after the other takes about
``hot + read``. ``gain_bound = cold / max(hot, read)`` is the most any
rewrite of the GEMM could win at that shape. Paths run one call each in a
rotating order; a time is the median over ``--calls`` calls.

The per-step lines weight the four layer GEMMs by ``--layers`` (30 for
SmolLM2) and add the LM head once.

Usage: python benchmarks/kernels/decode_gemm_stream.py --json-out benchmarks/results/decode_gemm_stream.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from packed_gemm_rows import _hint, machine, time_rotating, write_json
from shapes import LAYER_SHAPES, SHAPES


def gemm_path(rows: int, threads: int) -> str:
    """The GEMM the plugin's cpu backend runs for a bf16 model at ``rows``."""
    from vllm_br.device.cpu_kernels import bf16_gemm as matmul
    from vllm_br.device.cpu_kernels import packed_linear

    if packed_linear.host_supported():
        return "packed_bf16"
    return "fp32_copy" if matmul.use_fp32_copy(rows, "auto", threads) else "plain_bf16"


def measure(
    out_f: int,
    in_f: int,
    rows: int,
    calls: int,
    pool_mib: float,
    hint: int | None,
    path: str,
) -> dict[str, float]:
    dtype = torch.float32 if path == "fp32_copy" else torch.bfloat16
    nbytes = out_f * in_f * dtype.itemsize
    pool = max(2, -(-int(pool_mib * 2**20) // nbytes))
    plain = [(torch.randn(out_f, in_f) * 0.05).to(dtype) for _ in range(pool)]
    # The read path streams its own copies, so that the GEMM's pool is no
    # warmer for it.
    words = [w.clone().view(torch.float32) for w in plain]
    x = torch.randn(rows, in_f).to(dtype)
    if path == "packed_bf16":
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in plain]

        def gemm(w: torch.Tensor) -> None:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    else:
        weights = plain

        def gemm(w: torch.Tensor) -> None:
            F.linear(x, w)

    paths = {
        "hot": lambda i: gemm(weights[0]),
        "cold": lambda i: gemm(weights[i]),
        "read": lambda i: words[i].sum(),
    }
    times = time_rotating(paths, calls, pool)
    m = {f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items()}
    m["bytes"] = nbytes
    m["gflops_hot"] = 2 * rows * out_f * in_f / m["hot_us"] / 1e3
    m["gbs_cold"] = nbytes / m["cold_us"] / 1e3
    m["gbs_read"] = nbytes / m["read_us"] / 1e3
    m["overlap_bound_us"] = max(m["hot_us"], m["read_us"])
    m["serial_us"] = m["hot_us"] + m["read_us"]
    m["gain_bound"] = m["cold_us"] / m["overlap_bound_us"]
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hint", default="128", help="oneDNN batch hint (none: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=61, help="per path and shape")
    p.add_argument("--pool-mib", type=float, default=640.0)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    path = gemm_path(args.rows, args.threads)
    print(f"GEMM path at {args.rows} rows on this host: {path}")
    print(
        f"{'shape':13} {'MB':>6} {'hot us':>8} {'cold us':>8} {'read us':>8}"
        f" {'GFLOP/s hot':>11} {'GB/s cold':>9} {'GB/s read':>9}"
        f" {'hot+read':>8} {'gain_bound':>10}"
    )
    results = {}
    for name, (out_f, in_f) in shapes.items():
        m = measure(
            out_f, in_f, args.rows, args.calls, args.pool_mib, _hint(args.hint), path
        )
        results[name] = m
        print(
            f"{name:13} {m['bytes'] / 1e6:6.2f} {m['hot_us']:8.1f} {m['cold_us']:8.1f}"
            f" {m['read_us']:8.1f} {m['gflops_hot']:11.0f} {m['gbs_cold']:9.1f}"
            f" {m['gbs_read']:9.1f} {m['serial_us']:8.1f} {m['gain_bound']:10.2f}",
            flush=True,
        )
    step = {}
    for key in ("hot_us", "cold_us", "read_us", "overlap_bound_us"):
        step[key.replace("_us", "_ms")] = (
            sum(
                results[s][key] * (args.layers if s in LAYER_SHAPES else 1)
                for s in results
            )
            / 1e3
        )
    step["saving_bound_ms"] = step["cold_ms"] - step["overlap_bound_ms"]
    print(
        f"per decode step ({args.layers} layers + LM head, {args.rows} rows):"
        f" cold {step['cold_ms']:.1f} ms, hot {step['hot_ms']:.1f} ms,"
        f" read {step['read_ms']:.1f} ms, overlap bound"
        f" {step['overlap_bound_ms']:.1f} ms: at most"
        f" {step['saving_bound_ms']:.1f} ms to gain"
    )
    doc = dict(
        command=(
            "python benchmarks/kernels/decode_gemm_stream.py"
            f" --rows {args.rows} --shapes {args.shapes} --layers {args.layers}"
            f" --hint {args.hint} --threads {args.threads} --calls {args.calls}"
            f" --pool-mib {args.pool_mib}"
        ),
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=machine(),
        path=path,
        shapes=results,
        per_step=step,
    )
    write_json(args.json_out, doc)


if __name__ == "__main__":
    main()
