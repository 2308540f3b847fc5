"""Plot a soak.py report: resident memory of each server process and KV-cache
usage over time, and completed tokens per minute.

Runs wherever matplotlib is installed (the plugin venv does not carry it):
    python benchmarks/soak_plot.py results/soak-<host>.json results/soak-<host>.png
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.load(open(argv[0]))
    samples = report["samples"]
    fig, (mem, kv, tput) = plt.subplots(3, 1, figsize=(10, 10), sharex=False)
    keys = sorted({k for s in samples for k in s["rss_mib"]})
    for key in keys:
        pts = [(s["t"] / 60, s["rss_mib"][key]) for s in samples if key in s["rss_mib"]]
        mem.plot([t for t, _ in pts], [v for _, v in pts], label=key)
    mem.set_ylabel("resident memory (MiB)")
    mem.set_xlabel("minute")
    mem.legend(fontsize=7)
    mem.set_title(
        f"soak: {report['concurrency']} streams for {report['minutes']} min on "
        f"{report['host']} ({report['errors']} errors)"
    )
    kv.plot([s["t"] / 60 for s in samples], [100 * s["kv_usage"] for s in samples])
    kv.set_ylabel("KV cache used (%)")
    kv.set_xlabel("minute")
    pm = report["per_minute"]
    tput.bar([m["minute"] for m in pm], [m["tokens"] for m in pm])
    tput.set_ylabel("tokens completed")
    tput.set_xlabel("minute")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
