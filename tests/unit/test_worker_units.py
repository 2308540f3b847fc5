"""Worker pieces without an engine: the torch slot-mapping kernel (vs a
per-token reference and registered over vLLM's Triton kernel) and the
KV-cache sizing of SUPAWorker.determine_available_memory."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_br import compat
from vllm_br.errors import SUPAConfigError
from vllm_br.worker.kernel_overrides import compute_slot_mapping

PAD = -1


def _reference(num_tokens, max_num_tokens, qsl, positions, block_table, block_size):
    """Straight from the Triton kernel: per request, per token."""
    out = [PAD] * max_num_tokens
    qsl = qsl.tolist()
    for req in range(len(qsl) - 1):
        for t in range(qsl[req], qsl[req + 1]):
            if t >= num_tokens:
                break
            pos = int(positions[t])
            block = int(block_table[req, pos // block_size])
            out[t] = block * block_size + pos % block_size
    return torch.tensor(out, dtype=torch.int64)


def _case(gen, num_reqs, max_reqs, max_blocks, block_size, max_query, pad_qsl):
    """Random block table, ragged query lengths (some 0), positions that
    continue each request's context; query_start_loc padded with its last
    value up to max_reqs + 1 when pad_qsl."""
    block_table = torch.randint(
        0, 10_000, (max_reqs, max_blocks), generator=gen, dtype=torch.int32
    )
    lens = torch.randint(0, max_query + 1, (num_reqs,), generator=gen).tolist()
    positions = []
    for n in lens:
        ctx = int(torch.randint(0, max_blocks * block_size - n, (1,), generator=gen))
        positions += range(ctx, ctx + n)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    if pad_qsl:
        qsl += [qsl[-1]] * (max_reqs - num_reqs)
    return (
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int64),
        block_table,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [16, 128])
def test_compute_slot_mapping_matches_reference(seed, block_size):
    gen = torch.Generator().manual_seed(seed)
    num_reqs = 1 + seed
    max_reqs = num_reqs + 3
    qsl, positions, block_table = _case(
        gen,
        num_reqs,
        max_reqs,
        max_blocks=6,
        block_size=block_size,
        max_query=40 if seed % 2 else 3,
        pad_qsl=seed >= 2,
    )
    num_tokens = int(qsl[-1])
    max_num_tokens = num_tokens + 17
    slot = torch.full((max_num_tokens,), 12345, dtype=torch.int64)
    compute_slot_mapping(
        num_tokens,
        max_num_tokens,
        qsl,
        positions,
        block_table,
        block_table.stride(0),
        slot,
        block_size,
        1,
        0,
        1,
        PAD,
        1024,
    )
    expected = _reference(
        num_tokens, max_num_tokens, qsl, positions, block_table, block_size
    )
    torch.testing.assert_close(slot, expected, rtol=0, atol=0)
    assert (slot[num_tokens:] == PAD).all()


def test_compute_slot_mapping_no_tokens_only_pads():
    slot = torch.full((8,), 7, dtype=torch.int64)
    compute_slot_mapping(
        0,
        8,
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros((2, 4), dtype=torch.int32),
        4,
        slot,
        128,
        PAD_ID=PAD,
    )
    assert (slot == PAD).all()


def test_compute_slot_mapping_leaves_beyond_max_untouched():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    positions = torch.tensor([127, 128])
    block_table = torch.tensor([[5, 9]], dtype=torch.int32)
    slot = torch.full((6,), 42, dtype=torch.int64)
    compute_slot_mapping(2, 4, qsl, positions, block_table, 2, slot, 128, PAD_ID=PAD)
    assert slot.tolist() == [5 * 128 + 127, 9 * 128, PAD, PAD, 42, 42]


def test_context_parallelism_is_refused():
    with pytest.raises(NotImplementedError):
        compute_slot_mapping(
            1,
            1,
            torch.tensor([0, 1]),
            torch.tensor([0]),
            torch.zeros((1, 1), dtype=torch.int32),
            1,
            torch.empty(1, dtype=torch.int64),
            128,
            TOTAL_CP_WORLD_SIZE=2,
        )


def test_registered_over_vllm_triton_kernel(monkeypatch):
    import warnings

    import numba  # noqa: F401 (see below)
    from vllm.triton_utils import dispatcher
    from vllm.v1.worker import block_table as bt

    from vllm_br.worker import kernel_overrides

    # Registering scans every module (torch.distributed's deprecated
    # reduce_op included) without a warning reaching the user, and with
    # numba (llvmlite) imported, whose ffi object breaks vLLM's scan.
    monkeypatch.setattr(kernel_overrides, "_installed", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel_overrides.register_kernel_overrides()
    assert [str(w.message) for w in caught] == []
    kernel_overrides.register_kernel_overrides()  # idempotent
    name = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
    assert compat.SLOT_MAPPING_KERNEL == name
    assert name in dispatcher._registry
    _original, impl = dispatcher._registry[name]
    assert impl is compute_slot_mapping
    wrapper = bt.ComputeSlotMappingKernel.kernel
    assert isinstance(wrapper, dispatcher.KernelOverride)
    assert wrapper.func is compute_slot_mapping

    # vLLM's own launcher (what BlockTable.compute_slot_mapping calls) now
    # runs the torch implementation.
    qsl = torch.tensor([0, 3, 3, 5, 5], dtype=torch.int32)  # padded, one empty req
    positions = torch.tensor([0, 1, 2, 130, 131], dtype=torch.int64)
    table = torch.tensor([[1, 2], [7, 8], [3, 4], [0, 0]], dtype=torch.int32)
    slot = torch.empty(8, dtype=torch.int64)
    bt._COMPUTE_SLOT_MAPPING_KERNEL(
        3, 5, 8, qsl, positions, table, table.stride(0), slot, 128, 1, 0, 1
    )
    assert slot.tolist() == [128, 129, 130, 514, 515] + [bt.PAD_SLOT_ID] * 3


# ---- KV-cache sizing ----------------------------------------------------------
class _Backend:
    name = "cpu"
    memory_setting = "VLLM_BR_CPU_MEMORY_GIB"  # the cpu backend's capability

    def __init__(self, free: int, total: int, peak: int) -> None:
        self.free, self.total, self.peak = free, total, peak
        self.calls: list[str] = []

    def reset_peak_memory_stats(self, index=None):
        self.calls.append("reset")

    def synchronize(self, index=None):
        self.calls.append("sync")

    def mem_get_info(self, index=None):
        return self.free, self.total

    def max_memory_allocated(self, index=None):
        return self.peak


def _worker(
    utilization: float, total: int, explicit: int | None = None, graph_bytes: int = 0
):
    runs = []
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(
            kv_cache_memory_bytes=explicit, gpu_memory_utilization=utilization
        ),
        model_runner=types.SimpleNamespace(
            profile_run=lambda: runs.append(1),
            profile_graph_memory=lambda: graph_bytes,
        ),
        vllm_config=types.SimpleNamespace(),
        requested_memory=int(total * utilization),
        runs=runs,
    )


@pytest.fixture
def worker_mod():
    return pytest.importorskip("vllm_br.worker.worker")


GIB = 1 << 30


def test_available_memory_is_requested_minus_peak(worker_mod, monkeypatch):
    backend = _Backend(free=6 * GIB, total=8 * GIB, peak=1 * GIB)
    monkeypatch.setattr(worker_mod, "get_backend", lambda: backend)
    w = _worker(0.5, 8 * GIB)
    got = worker_mod.SUPAWorker.determine_available_memory(w)
    # in use = max(peak 1, total - free 2) = 2 GiB; requested 4 GiB.
    assert got == 2 * GIB
    assert w.available_kv_cache_memory_bytes == 2 * GIB
    assert w.runs == [1]
    assert backend.calls[0] == "reset"


def test_graph_memory_is_kept_out_of_the_kv_cache(worker_mod, monkeypatch):
    backend = _Backend(free=6 * GIB, total=8 * GIB, peak=1 * GIB)
    monkeypatch.setattr(worker_mod, "get_backend", lambda: backend)
    w = _worker(0.5, 8 * GIB, graph_bytes=GIB // 2)
    # requested 4 GiB - in use 2 GiB - graphs 0.5 GiB.
    assert worker_mod.SUPAWorker.determine_available_memory(w) == 3 * GIB // 2
    assert w.graph_memory_estimate == GIB // 2


def test_available_memory_counts_use_beyond_the_peak(worker_mod, monkeypatch):
    # Another process holds memory: in use 7 GiB (total - free) > peak 1 GiB,
    # so requested 7.6 GiB leaves 0.6 GiB.
    backend = _Backend(free=1 * GIB, total=8 * GIB, peak=1 * GIB)
    monkeypatch.setattr(worker_mod, "get_backend", lambda: backend)
    got = worker_mod.SUPAWorker.determine_available_memory(_worker(0.95, 8 * GIB))
    assert got == int(8 * GIB * 0.95) - 7 * GIB
    assert got <= backend.free


def test_explicit_kv_cache_bytes(worker_mod, monkeypatch):
    backend = _Backend(free=4 * GIB, total=8 * GIB, peak=1 * GIB)
    monkeypatch.setattr(worker_mod, "get_backend", lambda: backend)
    assert (
        worker_mod.SUPAWorker.determine_available_memory(
            _worker(0.5, 8 * GIB, explicit=GIB)
        )
        == GIB
    )
    with pytest.raises(SUPAConfigError, match="--kv-cache-memory-bytes"):
        worker_mod.SUPAWorker.determine_available_memory(
            _worker(0.5, 8 * GIB, explicit=5 * GIB)
        )


def test_no_memory_left_is_one_sentence(worker_mod, monkeypatch):
    backend = _Backend(free=7 * GIB, total=8 * GIB, peak=3 * GIB)
    monkeypatch.setattr(worker_mod, "get_backend", lambda: backend)
    with pytest.raises(SUPAConfigError) as info:
        worker_mod.SUPAWorker.determine_available_memory(_worker(0.25, 8 * GIB))
    msg = str(info.value)
    assert "--gpu-memory-utilization 0.25" in msg
    assert "VLLM_BR_CPU_MEMORY_GIB" in msg
    assert "\n" not in msg and msg.endswith(".")


# ---- start-up GC ----------------------------------------------------------------
class _StopHere(Exception):
    pass


def test_init_device_freezes_the_imported_heap_first(worker_mod, monkeypatch):
    """The worker freezes what the imports left before anything else, so the
    gc.collect() calls vLLM makes while loading and profiling scan only what
    start-up creates (about 3 s less start-up per engine on 2 cores)."""
    import gc

    def stop():
        raise _StopHere

    monkeypatch.setattr(worker_mod, "get_backend", stop)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(_StopHere):
            worker_mod.SUPAWorker.init_device(types.SimpleNamespace())
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process's heap as it was


# ---- float32 weights served in bfloat16: one line, not one per weight ------
def test_narrowing_weight_casts_become_one_line():
    import logging

    from vllm.model_executor.models import utils as vllm_model_utils

    from vllm_br.worker.weight_casts import summarized_weight_casts

    passed: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = passed.append
    vllm_logger = logging.getLogger(compat.WEIGHT_DTYPE_WARNING_LOGGER)
    assert vllm_model_utils.logger is vllm_logger
    plugin_logger = logging.getLogger("test.weight_casts")
    plugin_logger.setLevel(logging.INFO)
    summaries: list[logging.LogRecord] = []
    plugin_handler = logging.Handler(logging.INFO)
    plugin_handler.emit = summaries.append
    plugin_logger.addHandler(plugin_handler)
    vllm_logger.addHandler(handler)
    try:
        with summarized_weight_casts(plugin_logger) as casts:
            for name in ("a.weight", "b.weight", "c.weight"):
                vllm_logger.warning(
                    compat.WEIGHT_DTYPE_WARNING, name, torch.float32, torch.bfloat16
                )
            # Casts that lose more than rounding, and other messages, still warn.
            vllm_logger.warning(
                compat.WEIGHT_DTYPE_WARNING, "q.weight", torch.int8, torch.bfloat16
            )
            vllm_logger.warning("something else %s", "x")
        vllm_logger.warning(
            compat.WEIGHT_DTYPE_WARNING, "later.weight", torch.float32, torch.bfloat16
        )
    finally:
        vllm_logger.removeHandler(handler)
        plugin_logger.removeHandler(plugin_handler)
    assert casts.casts == {(torch.float32, torch.bfloat16): 3}
    assert [r.args[0] for r in passed if r.msg == compat.WEIGHT_DTYPE_WARNING] == [
        "q.weight",
        "later.weight",  # the filter is gone after loading
    ]
    assert any(r.msg == "something else %s" for r in passed)
    assert [r.getMessage() for r in summaries] == [
        "3 weights stored in float32 are served in bfloat16, the model's dtype; "
        "pass --dtype float32 to serve them as stored."
    ]
