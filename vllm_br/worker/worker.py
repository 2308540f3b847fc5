"""SUPAWorker: vLLM's V1 GPU worker, on a SUPA device through the device layer.

Overrides only what the GPU worker does in CUDA terms: device init, the
sleep-mode memory pool, and KV-cache sizing from the device's real free
memory.
"""

from __future__ import annotations

import gc
import os
from contextlib import AbstractContextManager, nullcontext

import torch
from vllm.config import CompilationMode, CUDAGraphMode, set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group
from vllm.platforms import current_platform
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_br.device import get_backend
from vllm_br.distributed import supernode_groups
from vllm_br.errors import SUPAConfigError
from vllm_br.logger import init_logger
from vllm_br.ops.registry import resolve_all
from vllm_br.worker.model_runner import SUPAModelRunner, install_stream_aliases
from vllm_br.worker.weight_casts import summarized_weight_casts

logger = init_logger(__name__)


def _device_index(assigned_physical_ids: list[int] | None, local_rank: int) -> int:
    """This worker's SUPA device. Where vLLM assigned the node's devices (the
    Ray executor: the ids Ray gave the workers; data parallelism), the local
    rank indexes them, mapped through SUPA_VISIBLE_DEVICES; else it is the
    device itself."""
    if assigned_physical_ids is None:
        return local_rank
    from vllm.platforms.interface import set_assigned_physical_gpu_ids

    set_assigned_physical_gpu_ids(assigned_physical_ids)
    return current_platform.logical_device_id_to_visible_device_id(local_rank)


class SUPAWorker(Worker):
    def init_device(self) -> None:
        # Everything imported so far (torch, transformers, vLLM) lives as long
        # as the process: freeze it, so the gc.collect() calls vLLM makes
        # while loading and profiling (six of them, each a full scan of that
        # heap, ~0.7 s on 2 cores) only scan what start-up creates.
        # compile_or_warm_up_model unfreezes it and freezes the whole heap for
        # serving, as vLLM does once start-up is done (freeze_gc_heap).
        gc.freeze()
        backend = get_backend()
        install_stream_aliases(backend)
        backend.install_torch_accelerator()
        index = _device_index(
            self.parallel_config.assigned_physical_gpu_ids, self.local_rank
        )
        if index >= backend.device_count():
            raise SUPAConfigError(
                f"Worker {self.rank} needs device supa:{index} but only "
                f"{backend.device_count()} SUPA devices are visible; lower "
                "--tensor-parallel-size / --data-parallel-size or check "
                "SUPA_VISIBLE_DEVICES."
            )
        backend.set_device(index)
        self.device = backend.torch_device(index)
        resolve_all()
        current_platform.check_if_supports_dtype(self.model_config.dtype)

        # Ledger patch supernode-tp-groups (a pass-through while
        # VLLM_BR_ENABLE_TP_GROUPS_IN_SUPERNODE is unset).
        supernode_groups.install()
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)

        gc.collect()
        backend.empty_cache()
        free, total = backend.mem_get_info(index)
        self.init_free_memory = free
        self.total_device_memory = total
        self.requested_memory = int(total * self.cache_config.gpu_memory_utilization)
        logger.info(
            "SUPA device %s (%s backend, %s): %s GiB free of %s GiB at start-up; "
            "%s GiB requested (--gpu-memory-utilization %.2f).",
            index,
            backend.name,
            backend.get_device_properties(index).name,
            format_gib(free),
            format_gib(total),
            format_gib(self.requested_memory),
            self.cache_config.gpu_memory_utilization,
        )
        self._init_workspace_and_model_runner()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        with summarized_weight_casts(logger):
            super().load_model(load_dummy_weights=load_dummy_weights)
        # vLLM drops torch to one intra-op thread for serving, since on a card
        # host ops only schedule work. A backend may want more (in emulation
        # the host *is* the device), unless the user set OMP_NUM_THREADS.
        threads = get_backend().worker_threads(self.parallel_config.world_size)
        # vLLM itself exports OMP_NUM_THREADS to spawned workers (and marks it
        # with VLLM_OMP_NUM_THREADS_SET_BY_VLLM=1); only a user's value counts.
        user_set = "OMP_NUM_THREADS" in os.environ and (
            os.environ.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM") != "1"
        )
        if threads is not None and not user_set:
            torch.set_num_threads(threads)

    def _make_model_runner(self) -> SUPAModelRunner:
        return SUPAModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # No sleep-mode allocator on SUPA (is_sleep_mode_available() is False).
        return nullcontext()

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the requested share of the device minus what
        the weights and a worst-case forward pass (the profile run) use."""
        backend = get_backend()
        explicit = self.cache_config.kv_cache_memory_bytes
        backend.reset_peak_memory_stats()
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        backend.synchronize()
        gc.collect()
        free, total = backend.mem_get_info()
        in_use = max(backend.max_memory_allocated(), total - free)
        # Graphs captured after the KV cache is allocated must fit beside it.
        graph_bytes = self.model_runner.profile_graph_memory()
        self.graph_memory_estimate = graph_bytes
        if explicit:
            if explicit > free:
                raise SUPAConfigError(
                    f"--kv-cache-memory-bytes {explicit} is more than the "
                    f"{free} bytes free on the SUPA device; lower it."
                )
            self.available_kv_cache_memory_bytes = explicit
            logger.info(
                "KV cache: %s GiB as set by --kv-cache-memory-bytes.",
                format_gib(explicit),
            )
            return explicit
        # Everything in use on the device after the profile run, at its peak
        # (at least total - free, so the result never exceeds what is free),
        # plus the graphs to come.
        available = self.requested_memory - in_use - graph_bytes
        if available <= 0:
            raise SUPAConfigError(
                f"--gpu-memory-utilization {self.cache_config.gpu_memory_utilization} "
                f"leaves no memory for the KV cache: the model and its activations "
                f"use {format_gib(in_use)} GiB of the device's {format_gib(total)} "
                "GiB; raise --gpu-memory-utilization, use a smaller model"
                + (
                    f", or raise {backend.memory_setting}."
                    if backend.memory_setting
                    else "."
                )
            )
        self.available_kv_cache_memory_bytes = available
        logger.info(
            "KV cache: %s GiB available (device %s GiB, requested %s GiB, weights "
            "and peak activations %s GiB, graphs %s GiB).",
            format_gib(available),
            format_gib(total),
            format_gib(self.requested_memory),
            format_gib(in_use),
            format_gib(graph_bytes),
        )
        return int(available)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Compile (VLLM_COMPILE), capture the SUPA graphs, warm up the sampler
        at its largest shape, then reset the seed.

        Follows vLLM 0.33's Worker._compile_or_warm_up_model
        (vllm/v1/worker/gpu_worker.py:940-1125) less its Triton/CUDA kernel
        warm-ups, which do not exist on SUPA, and its CUDA-only capture
        contexts."""
        for size in self._compile_warmup_sizes():
            logger.info("Compiling and warming up the model for %d tokens.", size)
            self.model_runner._dummy_run(size, skip_eplb=True, remove_lora=False)
        graph_bytes = 0
        if not self.model_config.enforce_eager:
            graph_bytes = self.model_runner.capture_model()
        estimate = getattr(self, "graph_memory_estimate", 0)
        if graph_bytes or estimate:
            logger.info(
                "SUPA graph memory: %s GiB captured, %s GiB estimated before the "
                "KV cache was sized.",
                format_gib(graph_bytes),
                format_gib(estimate),
            )
        if get_pp_group().is_last_rank:
            max_num_reqs = min(
                self.scheduler_config.max_num_seqs,
                self.scheduler_config.max_num_batched_tokens,
            )
            hidden_states, last_hidden_states = self.model_runner._dummy_run(
                num_tokens=max_num_reqs,
                skip_eplb=True,
                cudagraph_runtime_mode=CUDAGraphMode.NONE,
            )
            if self.model_runner.is_pooling_model:
                self.model_runner._dummy_pooler_run(hidden_states)
            else:
                self.model_runner._dummy_sampler_run(hidden_states=last_hidden_states)
        set_random_seed(
            self.model_config.seed, self.parallel_config.data_parallel_index
        )
        # Weights and KV cache are static from here on: keep them out of GC
        # scans. Unfrozen first, so the one full collection in freeze_gc_heap
        # also frees what the imports left (init_device froze it) and serving
        # starts from the same heap as without the early freeze.
        gc.unfreeze()
        freeze_gc_heap()
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _compile_warmup_sizes(self) -> list[int]:
        """Batch sizes to compile ahead of serving, largest first (the GPU
        worker's rule, vllm/v1/worker/gpu_worker.py:941-966 in vLLM 0.33):
        compile_sizes not captured as graphs, plus the end of every compile
        range no such size or capture size falls into."""
        cc = self.compilation_config
        if cc.mode != CompilationMode.VLLM_COMPILE or not has_compiled_submodule(
            self.model_runner.get_model()
        ):
            return []
        captured = (
            list(cc.cudagraph_capture_sizes or [])
            if cc.cudagraph_mode != CUDAGraphMode.NONE
            else []
        )
        sizes = [s for s in (cc.compile_sizes or []) if s not in captured]
        covered = set(captured) | {s for s in sizes if isinstance(s, int)}
        for compile_range in cc.get_compile_ranges():
            if not any(s in compile_range for s in covered):
                sizes.append(compile_range.end)
        return sorted(sizes, reverse=True)

    def sleep(self, level: int = 1) -> None:
        raise SUPAConfigError("Sleep mode is not supported on SUPA; serve without it.")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise SUPAConfigError("Sleep mode is not supported on SUPA; serve without it.")
