"""Is a serving engine's memory growth Python objects or native buffers?

Runs an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the
soak's kind of load, in waves of 48 requests (random prompts of 5-200 words,
16-128 tokens at temperature 0.7), and after each wave prints its time, the
process RSS, the live (unfrozen) Python objects and tracemalloc's traced
Python memory; at the end the Python allocations that grew most. RSS that
rises while traced memory stays flat is native (torch buffers, allocator).

Usage: VLLM_BR_DEVICE=cpu .venv/bin/python benchmarks/memory_waves.py <model dir> [waves]
"""

import gc
import os
import random
import sys
import time
import tracemalloc

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    import psutil
    from vllm import LLM, SamplingParams

    model, waves = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    llm = LLM(model=model, max_model_len=2048)
    words = "the a model card token stream memory graph block cache device".split()
    rng = random.Random(0)
    proc = psutil.Process()

    def wave() -> None:
        prompts = [
            " ".join(rng.choice(words) for _ in range(rng.randint(5, 200)))
            for _ in range(48)
        ]
        params = [
            SamplingParams(max_tokens=rng.randint(16, 128), temperature=0.7)
            for _ in prompts
        ]
        llm.generate(prompts, params, use_tqdm=False)

    wave()  # warm-up
    gc.collect()
    tracemalloc.start(10)
    start = tracemalloc.take_snapshot()
    for i in range(waves):
        t = time.time()
        wave()
        gc.collect()
        print(
            f"wave {i}: {time.time() - t:5.1f}s rss {proc.memory_info().rss / 2**20:8.1f} MiB "
            f"objects {len(gc.get_objects())} "
            f"traced {tracemalloc.get_traced_memory()[0] / 2**20:7.1f} MiB",
            flush=True,
        )
    for stat in tracemalloc.take_snapshot().compare_to(start, "traceback")[:5]:
        print(stat)


if __name__ == "__main__":
    main()
