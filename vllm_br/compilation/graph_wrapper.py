"""SUPAGraphWrapper: vLLM's static-graph wrapper on the SUPA platform.

The platform names it in ``get_static_graph_wrapper_cls()`` (vLLM wraps each
piecewise-compiled submodule with it) and the SUPA model runner wraps the
whole model with it for FULL graphs. Per batch descriptor it runs eagerly,
captures once, or replays, exactly like vLLM's ``CUDAGraphWrapper``; the
graph itself comes from the device layer (``torch.supa.SUPAGraph`` on a
card, an emulated graph on the ``cpu`` backend), captured into the
platform's one shared pool.

It subclasses ``CUDAGraphWrapper`` for the bookkeeping vLLM's runner reaches
through that class (the instance registry behind ``clear_all_graphs``,
``unwrap``, attribute forwarding, the shared-pool lookup in ``__init__``) and
overrides only ``__call__``, which in the parent hard-codes
``torch.cuda.graph``.
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode
from vllm.forward_context import (
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
)

from vllm_br.device import get_backend
from vllm_br.logger import init_logger

logger = init_logger(__name__)


class SUPAGraphWrapper(CUDAGraphWrapper):
    """Captures and replays ``runnable`` per batch descriptor on SUPA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: batch descriptor -> the forward context its graph was captured in
        self._captured_contexts: dict[Any, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        forward_context = get_forward_context()
        mode = forward_context.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            # Profile/warm-up runs, eager batches, or a wrapper of the other
            # runtime mode (FULL and PIECEWISE wrappers nest).
            return self.runnable(*args, **kwargs)

        descriptor = forward_context.batch_descriptor
        assert descriptor is not None
        entry = self.concrete_cudagraph_entries.get(descriptor)
        if entry is None:
            entry = CUDAGraphEntry(batch_descriptor=descriptor)
            self.concrete_cudagraph_entries[descriptor] = entry
        if entry.cudagraph is None:
            return self._capture(entry, forward_context, args, kwargs)
        # A graph keeps what the host decided at capture time (shapes,
        # attention plan, Python ints) and re-reads only device memory. A
        # replay that runs Python (the cpu emulation, the stand-in device)
        # sees the capture's forward context, as a card's replay would.
        with override_forward_context(self._captured_contexts[descriptor]):
            return entry.cudagraph.replay()

    def _capture(
        self,
        entry: CUDAGraphEntry,
        forward_context: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        validate_cudagraph_capturing_enabled()
        if self.cudagraph_options.debug_log_enable:
            logger.debug(
                "Capturing a SUPA graph on (%s, %s)",
                self.runtime_mode.name,
                entry.batch_descriptor,
            )
        runnable = self.runnable

        def run(*static_args: Any) -> Any:
            # A graph keeps what the host decided at capture time (shapes,
            # attention plan, Python ints) and re-reads only device memory on
            # replay. Pinning the capture's forward context makes an emulated
            # replay see the same host-side state a card's replay would.
            with override_forward_context(forward_context):
                return runnable(*static_args, **kwargs)

        graph = get_backend().capture_graph(run, *args, pool=self.graph_pool)
        self._captured_contexts[entry.batch_descriptor] = forward_context
        entry.cudagraph = graph
        entry.output = graph.output
        entry.input_addresses = [a.data_ptr() for a in args if hasattr(a, "data_ptr")]
        compilation_counter.num_cudagraph_captured += 1
        return graph.output
