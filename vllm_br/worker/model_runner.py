"""SUPAModelRunner: vLLM's Model Runner V1 on a SUPA device.

vLLM's GPUModelRunner does all scheduling-side work (input batch, block
tables, sampling); it reaches the device through torch.cuda stream/event
names, which a SUPA worker aliases to the device layer
(``install_stream_aliases``, listed in the patch ledger). The overrides here
are the few places where the GPU runner assumes CUDA semantics.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_br import compat
from vllm_br.compilation.capture import capture_graphs, estimate_graph_memory
from vllm_br.compilation.graph_wrapper import SUPAGraphWrapper
from vllm_br.device import DeviceBackend, get_backend
from vllm_br.layers import matmul_weights, vision
from vllm_br.logger import init_logger
from vllm_br.ops import get_op

logger = init_logger(__name__)

_aliases_installed = False


def install_stream_aliases(backend: DeviceBackend) -> None:
    """Point torch.cuda's stream/event names (and torch.Event) at the device
    layer, in a worker process only (idempotent)."""
    global _aliases_installed
    if _aliases_installed:
        return
    impl = {
        "Stream": backend.Stream,
        "Event": backend.Event,
        "current_stream": backend.current_stream,
        "default_stream": backend.current_stream,
        "stream": backend.stream,
    }
    for name in compat.CUDA_STREAM_EVENT_NAMES:
        setattr(torch.cuda, name, impl[name])
    torch.Event = backend.Event  # type: ignore[misc]
    _aliases_installed = True


class SUPAModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.backend = get_backend()
        install_stream_aliases(self.backend)
        super().__init__(vllm_config, device)
        # Batch rows whose generators _sample put back this step.
        self._restored_generators: list[int] = []
        if self.backend.host_memory_is_device_memory:
            self._share_host_and_device_buffers()
        # The greedy step through the op registry (an instance attribute
        # shadows Sampler's staticmethod; the sampler object, also held by
        # the rejection sampler, stays the same).
        self.sampler.greedy_sample = get_op("greedy_sample")

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # The models' plain torch.nn.LayerNorm (vision towers) onto the layer_norm op
        # (patch ledger: torch-layer-norms).
        vision.adopt_torch_layer_norms(self.get_model())
        # Before profiling, so the copies are counted against the KV cache.
        matmul_weights.attach(self.get_model())
        matmul_weights.prepare(self.get_model())
        # vLLM's runner wraps the model for FULL graphs with its hard-coded
        # CUDAGraphWrapper; on SUPA the same wrapper position takes
        # SUPAGraphWrapper (PIECEWISE pieces get it from the platform).
        if type(self.model) is CUDAGraphWrapper:
            self.model = SUPAGraphWrapper(
                self.model.runnable, self.vllm_config, runtime_mode=CUDAGraphMode.FULL
            )

    def capture_model(self) -> int:
        """Capture every graph vLLM's dispatcher plans; returns graph bytes.
        (The GPU runner's version enters CUDA-only capture contexts.)"""
        return capture_graphs(self)

    def profile_graph_memory(self) -> int:
        """Bytes the graphs will hold, measured before the KV cache is sized."""
        return estimate_graph_memory(self)

    def _share_host_and_device_buffers(self) -> None:
        """In emulation host and device memory are the same: let each
        CpuGpuBuffer's device side be its host tensor, so the per-step
        host-to-device copies disappear (as vLLM's CPU runner does)."""
        for value in vars(self).values():
            if isinstance(value, CpuGpuBuffer):
                value.gpu = value.cpu
        for name, value in vars(self.input_batch).items():
            if name.endswith("_cpu_tensor") and isinstance(value, torch.Tensor):
                if isinstance(
                    getattr(self.input_batch, name[:-11], None), torch.Tensor
                ):
                    setattr(self.input_batch, name[:-11], value)
        for block_table in self.input_batch.block_table.block_tables:
            for value in vars(block_table).values():
                if isinstance(value, CpuGpuBuffer):
                    value.gpu = value.cpu

    def _sample(self, logits, spec_decode_metadata):
        """Sample, then put back the generators of requests whose token is
        discarded (a prefill chunk that is not the prompt's last), so a
        seeded request draws the same numbers however its prompt is chunked.
        vLLM rewinds them by Philox offset in _bookkeeping_sync; a host
        generator (mt19937) has no offset, a saved state works for any."""
        generators = self.input_batch.generators
        num_reqs = self.input_batch.num_reqs
        discarded = np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
        saved = {
            int(i): generators[int(i)].get_state()
            for i in discarded
            if int(i) in generators
        }
        output = super()._sample(logits, spec_decode_metadata)
        for i, state in saved.items():
            generators[i].set_state(state)
        self._restored_generators = list(saved)
        return output

    def _bookkeeping_sync(self, *args, **kwargs):
        # Hide the generators _sample already put back from vLLM's offset
        # rewind (which a host generator would refuse).
        generators = self.input_batch.generators
        hidden = {
            i: generators.pop(i) for i in self._restored_generators if i in generators
        }
        self._restored_generators = []
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)

    def _sync_device(self) -> None:
        self.backend.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        # The GPU runner copies through a pinned buffer and an event; without
        # pinned host memory (emulation) a plain copy does the same.
        if self.backend.pinned_host_memory:
            return super()._to_list(sampled_token_ids)
        return sampled_token_ids.tolist()

    def _init_kv_zero_meta(self) -> None:
        # The GPU runner precomputes raw addresses for a Triton zeroing kernel;
        # _zero_block_ids below indexes the per-layer views instead.
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        views: dict[int, torch.Tensor] = {}
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for layer_name in group.layer_names:
                ctx = self.compilation_config.static_forward_context.get(layer_name)
                kv = getattr(ctx, "kv_cache", None)
                if isinstance(kv, torch.Tensor):
                    views.setdefault(kv.data_ptr(), kv)
        self._kv_views_to_zero = list(views.values())

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero newly allocated KV blocks so partial writes never read stale
        data. Per-layer views are [num_blocks, ...] with blocks at dim 0."""
        views = getattr(self, "_kv_views_to_zero", None)
        if not block_ids or not views:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for kv in views:
            kv.index_fill_(0, ids, 0)
