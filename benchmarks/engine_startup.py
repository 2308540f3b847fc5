"""Engine start-up and shutdown time of one or more builds of the plugin.

    .venv/bin/python benchmarks/engine_startup.py                # this checkout
    .venv/bin/python benchmarks/engine_startup.py \\
        --builds old=/tmp/old,new=. --repeats 3                  # A/B, alternated

Each run is a fresh process (``--one``) with ``PYTHONPATH`` set to the build's
checkout, so imports are paid the way a user pays them. Per run:

    start = wall time of LLM(model, ...)           (the engine is ready)
    first = wall time of a 4-token generate          (the first request)
    stop  = wall time of the engine-core shutdown    (every process gone)

Rounds alternate the builds, so the machine's noise falls on all of them;
reported are the medians and min-max over ``--repeats`` rounds and each
build's ratio to the first one. The engine runs eager (no compile), which
isolates what the plugin and vLLM do at start-up from inductor's compile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path.home() / ".cache/vllm-br/models/SmolLM2-135M-Instruct"


def one(model: str, dtype: str) -> dict[str, float]:
    """Start, use and stop one engine in this process; the three wall times."""
    os.environ.setdefault("VLLM_BR_DEVICE", "cpu")
    os.environ.setdefault("VLLM_BR_CPU_MEMORY_GIB", "2")
    from vllm import LLM, SamplingParams  # imported before timing: not ours

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
    )
    t1 = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    t2 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    t3 = time.perf_counter()
    return {"start_s": t1 - t0, "first_s": t2 - t1, "stop_s": t3 - t2}


def run_build(path: Path, model: str, dtype: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one"]
    cmd += ["--model", model, "--dtype", dtype]
    out = subprocess.run(
        cmd, env=env, cwd=path, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{path}: run failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    first = next(iter(runs))
    table = {}
    for name, rs in runs.items():
        row = {}
        for key in ("start_s", "first_s", "stop_s"):
            values = [r[key] for r in rs]
            base = statistics.median(r[key] for r in runs[first])
            row[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "ratio_to_" + first: statistics.median(values) / base,
            }
        table[name] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--builds",
        default=f"this={ROOT}",
        help="name=checkout,... (a git worktree of another commit, for A/B)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        print("RESULT " + json.dumps(one(args.model, args.dtype)), flush=True)
        return

    builds = dict(item.split("=", 1) for item in args.builds.split(","))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(args.repeats):
        names = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for name in names:
            res = run_build(Path(builds[name]).resolve(), args.model, args.dtype)
            runs[name].append(res)
            print(
                f"round {r + 1} {name}: start {res['start_s']:.2f} s, "
                f"first {res['first_s']:.2f} s, stop {res['stop_s']:.2f} s",
                flush=True,
            )
    table = summarize(runs)
    first = next(iter(builds))
    for name, row in table.items():
        cells = ", ".join(
            f"{key.removesuffix('_s')} {v['median']:.2f} s "
            f"({v['min']:.2f}-{v['max']:.2f}, x{v['ratio_to_' + first]:.2f})"
            for key, v in row.items()
        )
        print(f"{name}: {cells}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"model": args.model, "dtype": args.dtype, "builds": builds,
                 "runs": runs, "summary": table},
                indent=1,
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
