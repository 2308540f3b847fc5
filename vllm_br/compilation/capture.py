"""Capturing the SUPA graphs vLLM's dispatcher plans, and measuring their memory.

The GPU model runner's ``capture_model`` / ``profile_cudagraph_memory``
(vllm/v1/worker/gpu_model_runner.py:6417-6570 and 6268-6416 in vLLM 0.33,
which these follow) wrap the same loop in CUDA-only contexts (``graph_capture`` asserts a CUDA or XPU
communicator, streams come from ``torch.cuda``); these are that loop on the
device layer. Both reuse the runner's own ``_warmup_and_capture`` (warm-up
runs, then the capturing dummy run) so the captured batches are exactly the
ones vLLM dispatches to.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.utils.mem_utils import format_gib

from vllm_br.logger import init_logger

if TYPE_CHECKING:
    from vllm_br.worker.model_runner import SUPAModelRunner

logger = init_logger(__name__)

#: Graph sizes captured per mode to estimate the memory of all of them: the
#: largest (which sets the shared pool's size) and one more (the per-graph
#: cost), as vLLM's CUDA profiler does.
_PROFILED_PER_MODE = 2


def _free_bytes(runner: SUPAModelRunner) -> int:
    runner.backend.synchronize()
    gc.collect()
    return runner.backend.mem_get_info()[0]


def capture_graphs(runner: SUPAModelRunner) -> int:
    """Capture every planned graph, largest first; returns the bytes they hold."""
    if runner.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    plan = runner.cudagraph_dispatcher.get_capture_descs()
    start = time.perf_counter()
    free_before = _free_bytes(runner)
    set_cudagraph_capturing_enabled(True)
    try:
        for mode, descs in plan:
            for desc in descs:
                runner._warmup_and_capture(desc, cudagraph_runtime_mode=mode)
    finally:
        set_cudagraph_capturing_enabled(False)
    used = max(0, free_before - _free_bytes(runner))
    logger.info(
        "SUPA graphs captured in %.1f s (%s), %s GiB in the shared graph pool.",
        time.perf_counter() - start,
        ", ".join(f"{mode.name}={len(descs)}" for mode, descs in plan) or "none",
        format_gib(used),
    )
    return used


def estimate_graph_memory(runner: SUPAModelRunner) -> int:
    """Capture a few graphs into a throw-away pool on a minimal KV cache and
    extrapolate to all planned graphs; everything captured is dropped."""
    if runner.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    with set_current_vllm_config(runner.vllm_config):
        runner._init_minimal_kv_cache_for_profiling()
    dispatcher = runner.cudagraph_dispatcher
    plan = dispatcher.get_capture_descs()
    saved_count = compilation_counter.num_cudagraph_captured
    wrappers = list(CUDAGraphWrapper._all_instances)
    saved_pools = {id(w): w.graph_pool for w in wrappers}
    profiling_pool = runner.backend.graph_pool_handle()
    for w in wrappers:
        w.graph_pool = profiling_pool
    first: dict[CUDAGraphMode, int] = {}
    rest = 0
    try:
        set_cudagraph_capturing_enabled(True)
        for mode, descs in plan:
            samples = []
            for desc in descs[:_PROFILED_PER_MODE]:
                before = _free_bytes(runner)
                runner._warmup_and_capture(desc, cudagraph_runtime_mode=mode)
                samples.append(max(0, before - _free_bytes(runner)))
            first[mode] = samples[0]
            per_graph = samples[1] if len(samples) > 1 else 0
            rest += per_graph * (len(descs) - 1)
    finally:
        set_cudagraph_capturing_enabled(False)
        CUDAGraphWrapper.clear_all_graphs()
        for w in wrappers:
            w.graph_pool = saved_pools[id(w)]
        for keys in dispatcher.cudagraph_keys.values():
            keys.clear()
        dispatcher.keys_initialized = False
        runner._cleanup_profiling_kv_cache()
        compilation_counter.num_cudagraph_captured = saved_count
    # FULL and PIECEWISE graphs share the pool and never replay at once: the
    # pool holds the larger first capture, plus every further graph's own cost.
    estimate = max(first.values(), default=0) + rest
    logger.info(
        "SUPA graph memory estimated at %s GiB (%s); it is kept out of the KV cache.",
        format_gib(estimate),
        ", ".join(f"{mode.name}={len(descs)}" for mode, descs in plan) or "none",
    )
    return estimate
