"""Run one benchmark workload through HF transformers ``generate``.

Batched generation with left padding (``attention_mask`` marks the pads),
greedy (``do_sample=False``), ``ignore_eos`` as ``min_new_tokens =
max_new_tokens``, bfloat16 weights, the default attention implementation
(SDPA), requests in workload order (no sorting by length).

W1: ``--batch-sizes 1,4,8,16,32,64`` tries each batch size on the first
``max(bs, --tune-requests)`` requests of W1 (full output length) and keeps
the fastest (output tokens/s); the timed repeats then run the whole of W1 at
that batch size. With one batch size there is no tuning. W2 runs at batch 1
and is measured as in ``workloads.py`` (TTFT = generate with 1 new token,
TPOT = (generate with 128 new tokens - TTFT) / 127).

Writes a JSON (``--json-out``) shaped like run_vllm.py's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl  # noqa: E402


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "numpy"):
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
    ap.add_argument("--workload", required=True, choices=["W1", "W2"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--label", default="hf")
    ap.add_argument("--dtype", default=wl.DTYPE)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument(
        "--batch-sizes",
        default="1,4,8,16,32,64",
        help="W1: comma-separated, fastest wins",
    )
    ap.add_argument("--tune-requests", type=int, default=16)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    work = wl.build(
        args.workload,
        args.model,
        num_requests=args.num_requests,
        output_len=args.output_len,
        prompt_len=args.prompt_len,
    )
    tok = wl.load_tokenizer(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype)
    )
    model.eval()
    startup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())

    def gen(prompts: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        got = out.shape[1] - width
        assert got == new_tokens, (got, new_tokens)
        return got * len(prompts)

    def run_batched(
        prompts: list[list[int]], bs: int, new_tokens: int
    ) -> tuple[float, int]:
        t = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), bs):
            n += gen(prompts[i : i + bs], new_tokens)
        return time.perf_counter() - t, n

    tuning: list[dict[str, Any]] = []
    batch_size = 1
    warm_s = 0.0
    if args.workload == "W1":
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        sizes = [min(s, len(work.prompts)) for s in sizes]
        sizes = sorted(set(sizes))
        if len(sizes) == 1:
            batch_size = sizes[0]
        else:
            for bs in sizes:
                sub = work.prompts[
                    : min(len(work.prompts), max(bs, args.tune_requests))
                ]
                sub = sub[: (len(sub) // bs) * bs]
                gen(sub[:bs], min(4, work.output_len))  # warm-up at this shape
                el, n = run_batched(sub, bs, work.output_len)
                tuning.append(
                    dict(
                        batch_size=bs,
                        requests=len(sub),
                        elapsed_s=el,
                        output_tokens_per_s=n / el,
                    )
                )
                print(
                    f"[run_hf] tune bs={bs}: {n / el:.1f} output tok/s on {len(sub)} requests",
                    flush=True,
                )
            batch_size = max(tuning, key=lambda r: r["output_tokens_per_s"])[
                "batch_size"
            ]
        t = time.perf_counter()
        gen(work.prompts[:batch_size], min(8, work.output_len))
        warm_s = time.perf_counter() - t
    else:
        t = time.perf_counter()
        gen(work.prompts, min(8, work.output_len))
        warm_s = time.perf_counter() - t

    repeats: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        with wl.Contention() as cont:
            if args.workload == "W1":
                el, n = run_batched(work.prompts, batch_size, work.output_len)
                assert n == work.output_tokens
                rec = wl.w1_metrics(el, work.prompt_tokens, n)
            else:
                t = time.perf_counter()
                gen(work.prompts, 1)
                ttft = time.perf_counter() - t
                t = time.perf_counter()
                gen(work.prompts, work.output_len)
                total = time.perf_counter() - t
                rec = wl.w2_metrics(ttft, total, work.output_len)
        rec.update(cont.stats)
        repeats.append(rec)

    result = dict(
        system=args.label,
        runner="run_hf.py",
        workload=args.workload,
        model=args.model,
        dtype=args.dtype,
        num_requests=len(work.prompts),
        prompt_tokens=work.prompt_tokens,
        output_len=work.output_len,
        prompts_digest=work.digest(),
        batch_size=batch_size,
        tuning=tuning,
        versions=versions(),
        facts=dict(
            params=int(n_params),
            torch_threads=torch.get_num_threads(),
            attn_implementation=getattr(model.config, "_attn_implementation", None),
        ),
        startup_s=startup_s,
        warmup_s=warm_s,
        repeats=repeats,
    )
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    summary = {
        k: round(v, 4) if isinstance(v, float) else v for k, v in repeats[-1].items()
    }
    print(
        f"[run_hf] {args.label} {args.workload} bs={batch_size}: {summary}", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
