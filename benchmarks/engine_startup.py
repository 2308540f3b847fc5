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

``--phases`` instead splits one start-up into where its time goes, in a
fresh process per repeat, with the engine core inside that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so every phase is timed where it runs:

    imports   import vllm (what a spawned engine core pays again)
    load      SUPAWorker.load_model (weights, the plugin's weight prep)
    profile   the profile run (determine_available_memory), less compile
    compile   torch.compile (vLLM's compilation_time; --mode compile|graphs)
    kv_cache  allocating the KV cache (initialize_from_config)
    warmup    compile warm-up sizes and the sampler warm-up
    capture   SUPA graph capture (--mode graphs)
    other     the rest of LLM(): configs, tokenizer, scheduler
    first, stop as above

    .venv/bin/python benchmarks/engine_startup.py --phases --mode eager \\
        --model <dir> --dtype float32 --repeats 3
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


MODES = {
    "eager": dict(enforce_eager=True),
    "compile": dict(
        compilation_config={"mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"}
    ),
    "graphs": dict(
        compilation_config={
            "mode": "VLLM_COMPILE",
            "cudagraph_mode": "FULL_AND_PIECEWISE",
        }
    ),
}


def phases(model: str, dtype: str, mode: str, tokens: int | None) -> dict[str, float]:
    """One start-up in this (fresh) process, split into phases."""
    t0 = time.perf_counter()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_BR_DEVICE", "cpu")
    os.environ.setdefault("VLLM_BR_CPU_MEMORY_GIB", "2")
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    from vllm import LLM, SamplingParams

    from vllm_br.worker.model_runner import SUPAModelRunner
    from vllm_br.worker.worker import SUPAWorker

    took = {"imports": time.perf_counter() - t0}

    # Timing wrappers around the worker's phase methods, in this throw-away
    # benchmark process only (not a product patch, so not in the ledger).
    def timed(cls, method: str, phase: str) -> None:
        fn = getattr(cls, method)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                took[phase] = took.get(phase, 0.0) + time.perf_counter() - t

        setattr(cls, method, wrapper)

    timed(SUPAWorker, "load_model", "load")
    timed(SUPAWorker, "determine_available_memory", "profile")
    timed(SUPAWorker, "initialize_from_config", "kv_cache")
    timed(SUPAWorker, "compile_or_warm_up_model", "warmup")
    timed(SUPAModelRunner, "capture_model", "capture")
    t = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=1024,
        max_num_batched_tokens=tokens,
        seed=0,
        **MODES[mode],
    )
    start = time.perf_counter() - t
    took["compile"] = llm.collective_rpc(
        lambda w: w.compilation_config.compilation_time
    )[0]
    took["profile"] -= took["compile"]  # vLLM compiles inside the profile run
    took["warmup"] = took["warmup"] - took.get("capture", 0.0)
    took.setdefault("capture", 0.0)
    took["other"] = start - sum(v for k, v in took.items() if k != "imports")
    t = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    took["first"] = time.perf_counter() - t
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    took["stop"] = time.perf_counter() - t
    return took


def run_phases(
    model: str, dtype: str, mode: str, tokens: int | None, repeats: int
) -> dict:
    """``repeats`` fresh processes of :func:`phases`; medians per phase."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-phases"]
    cmd += ["--model", model, "--dtype", dtype, "--mode", mode]
    if tokens:
        cmd += ["--max-num-batched-tokens", str(tokens)]
    runs = []
    for r in range(repeats):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"run failed:\n{out.stderr[-3000:]}")
        runs.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items())
        )
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median s: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    return {
        "model": model,
        "dtype": dtype,
        "mode": mode,
        "runs": runs,
        "median": medians,
    }


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
    ap.add_argument("--phases", action="store_true", help="split one start-up")
    ap.add_argument("--mode", choices=list(MODES), default="eager")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="--phases: the profile run's size (default: vLLM's, 8192 offline)",
    )
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one-phases", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        print("RESULT " + json.dumps(one(args.model, args.dtype)), flush=True)
        return
    if args.one_phases:
        result = phases(args.model, args.dtype, args.mode, args.max_num_batched_tokens)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.phases:
        doc = run_phases(
            args.model,
            args.dtype,
            args.mode,
            args.max_num_batched_tokens,
            args.repeats,
        )
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(doc, indent=1))
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
