"""Time to first token of one 448 x 448 image prompt on a Qwen2.5-VL-shaped
model, and the vision encoder's share of it.

Two random checkpoints built with ``tests/fixtures/tiny_vl`` (the
``qwen2_5_vl`` family's classes and processor, 1024 patches of 14 pixels
merged into 256 image tokens):

- ``tiny``: the test checkpoint (tower: 2 blocks of 32; decoder: 2 layers
  of 64);
- ``small``: tower 8 blocks of 320 (5 heads of 64, windowed attention but
  in blocks 3 and 7), decoder 4 layers of 512 (8 heads of 64, GQA 8:2).

Each config runs in its own process with the backend's defaults, bfloat16,
prefix caching and the processor cache off (every request encodes its image
again) and a new random image per request. After two warm-up requests, each
of ``--repeats`` requests is timed as TTFT = ``generate(max_tokens=1)``
wall time, and inside the worker the time spent in the model's
``embed_multimodal`` (the vision tower and merger) is summed. Prints the
median TTFT, the median encoder time and their ratio; ``--json-out`` keeps
every number.

Usage::

    .venv/bin/python benchmarks/vl_ttft.py --repeats 7 \\
        --json-out benchmarks/results/vl_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

IMAGE_SIDE = 448
CONFIGS = {
    "tiny": {},
    "small": {
        "vision_overrides": {
            "depth": 8,
            "hidden_size": 320,
            "intermediate_size": 1280,
            "num_heads": 5,
            "out_hidden_size": 512,
            "window_size": 112,
            "fullatt_block_indexes": [3, 7],
        },
        "text_overrides": {
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [8, 12, 12],
            },
        },
    },
}


def _install_encoder_timer(worker) -> None:
    """In the worker: time every ``embed_multimodal`` call."""
    from vllm_br.device import get_backend

    backend = get_backend()
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    inner = model.embed_multimodal
    model._br_encoder_s = 0.0

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        backend.synchronize()  # a card runs the tower asynchronously
        model._br_encoder_s += time.perf_counter() - start
        return out

    model.embed_multimodal = timed


def _take_encoder_time(worker) -> float:
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    spent, model._br_encoder_s = model._br_encoder_s, 0.0
    return spent


def child(name: str, repeats: int, out: Path) -> None:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    from tests.fixtures.tiny_vl import VL_FAMILIES, build_tiny_vl

    model_dir = Path(tempfile.mkdtemp(prefix=f"vl-{name}-"))
    build_tiny_vl("qwen2_5_vl", model_dir, max_image_tokens=256, **CONFIGS[name])
    llm = LLM(
        model=str(model_dir), dtype="bfloat16", max_model_len=2048, max_num_seqs=1,
        enable_prefix_caching=False, mm_processor_cache_gb=0,
        limit_mm_per_prompt={"image": 1}, seed=0,
    )  # fmt: skip
    llm.collective_rpc(_install_encoder_timer)
    prompt = f"Describe {VL_FAMILIES['qwen2_5_vl'].placeholder('image')} briefly."
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(0)
    ttft, encoder = [], []
    for i in range(2 + repeats):
        pixels = rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
        request = {
            "prompt": prompt,
            "multi_modal_data": {"image": Image.fromarray(pixels)},
        }
        llm.collective_rpc(_take_encoder_time)
        start = time.perf_counter()
        outputs = llm.generate([request], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        spent = llm.collective_rpc(_take_encoder_time)[0]
        if i >= 2:
            ttft.append(elapsed)
            encoder.append(spent)
    prompt_tokens = len(outputs[0].prompt_token_ids)
    out.write_text(
        json.dumps(
            {"ttft_s": ttft, "encoder_s": encoder, "prompt_tokens": prompt_tokens}
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.repeats, args.out)
        return 0
    results = {}
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--child", name, "--repeats",
                   str(args.repeats), "--out", str(out)]  # fmt: skip
            # collective_rpc sends the timer functions to the engine process.
            env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
            subprocess.run(cmd, check=True, env=env)
            r = json.loads(out.read_text())
        ttft, enc = statistics.median(r["ttft_s"]), statistics.median(r["encoder_s"])
        shares = [e / t for e, t in zip(r["encoder_s"], r["ttft_s"], strict=True)]
        r.update(
            median_ttft_s=ttft,
            median_encoder_s=enc,
            median_share=statistics.median(shares),
        )
        results[name] = r
        print(
            f"{name}: {r['prompt_tokens']} prompt tokens, TTFT {ttft * 1e3:.1f} ms "
            f"(min {min(r['ttft_s']) * 1e3:.1f}, max {max(r['ttft_s']) * 1e3:.1f}), "
            f"encoder {enc * 1e3:.1f} ms, share {r['median_share']:.2f}"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.processor()
            or platform.machine(), "device": os.environ.get("VLLM_BR_DEVICE", "auto"),
            "command": " ".join(sys.argv), "results": results,
        }, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
