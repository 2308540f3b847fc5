"""SUPA graphs and compilation without an engine: the platform's hooks and
defaults, SUPAGraphWrapper's capture / replay / eager dispatch on the
emulated graph (stale inputs, frozen host state, one shared pool), and the
attention plan a FULL graph keeps."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_BR_DEVICE", "cpu")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.compilation.counter import compilation_counter  # noqa: E402
from vllm.compilation.monitor import set_cudagraph_capturing_enabled  # noqa: E402
from vllm.config import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.forward_context import (  # noqa: E402
    BatchDescriptor,
    get_forward_context,
    set_forward_context,
)
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402

from vllm_br.compilation import defaults  # noqa: E402
from vllm_br.compilation.compiler import SUPACompiler  # noqa: E402
from vllm_br.compilation.graph_wrapper import SUPAGraphWrapper  # noqa: E402
from vllm_br.compilation.passes import SUPAPassManager  # noqa: E402
from vllm_br.device.cpu import (  # noqa: E402
    CPU_INDUCTOR_CONFIG,
    CpuBackend,
    EmulatedGraphPool,
)
from vllm_br.errors import SUPAConfigError  # noqa: E402
from vllm_br.ops.paged_attention import (  # noqa: E402
    make_paged_attention_plan,
    paged_attention,
)


def _engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **kwargs).create_engine_config()


# ---- platform hooks and defaults ------------------------------------------


def test_platform_names_the_supa_graph_wrapper_compiler_and_passes():
    assert current_platform.support_static_graph_mode()
    wrapper = resolve_obj_by_qualname(current_platform.get_static_graph_wrapper_cls())
    assert wrapper is SUPAGraphWrapper
    assert (
        resolve_obj_by_qualname(current_platform.get_compile_backend()) is SUPACompiler
    )
    assert (
        resolve_obj_by_qualname(current_platform.get_pass_manager_cls())
        is SUPAPassManager
    )
    assert isinstance(current_platform.graph_pool_handle(), EmulatedGraphPool)
    # vLLM's compiler factory takes the platform's compiler for a custom backend.
    compiler = SUPACompiler()
    assert compiler.name == "supa_inductor" and compiler.use_aot_compile is False
    assert CPU_INDUCTOR_CONFIG["cpp.dynamic_threads"] is True


def test_cpu_default_is_the_one_defaults_names(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir)
    mode_name, graph_name = CpuBackend.default_graph_modes
    assert cfg.compilation_config.mode == CompilationMode[mode_name]
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[graph_name]


def test_cpu_default_is_the_committed_measurement():
    """CpuBackend.default_graph_modes names what benchmarks/graph_modes.py chose in the run whose
    results are committed (docs/graphs.md quotes it)."""
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import graph_modes
    finally:
        sys.path.remove(str(bench))
    result = json.loads((bench / "results" / "graph_modes.json").read_text())
    assert sorted(map(int, result["median"]["eager"])) == [1, 8, 32]
    chosen = result["chosen"]
    assert all(r >= 1.0 for r in result["ratio_to_eager"][chosen].values())
    assert CpuBackend.default_graph_modes == graph_modes.AS_DEFAULT[chosen]


@pytest.mark.parametrize("backend", ["cpu", "supa"])
def test_defaults_fill_only_what_the_user_left_unset(backend):
    from vllm_br.device.supa import SupaBackend

    modes = {"cpu": CpuBackend, "supa": SupaBackend}[backend].default_graph_modes
    from vllm.config.vllm import OptimizationLevel

    def fake(mode=None, graph=None, level=OptimizationLevel.O2):
        cc = SimpleNamespace(mode=mode, cudagraph_mode=graph)
        return SimpleNamespace(compilation_config=cc, optimization_level=level)

    mode_name, graph_name = modes
    unset = fake()
    defaults.apply_graph_defaults(unset, modes)
    assert unset.compilation_config.mode == CompilationMode[mode_name]
    assert unset.compilation_config.cudagraph_mode == CUDAGraphMode[graph_name]
    chosen = fake(CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE)
    defaults.apply_graph_defaults(chosen, modes)
    assert chosen.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    leveled = fake(level=OptimizationLevel.O3)
    defaults.apply_graph_defaults(leveled, modes)
    assert leveled.compilation_config.mode is None  # vLLM's -O3 resolves it


def test_user_graph_and_compile_settings_are_kept(tiny_llama_dir):
    from vllm_br.compilation import COMPILER_CLS

    cfg = _engine_config(
        tiny_llama_dir,
        compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
    )
    cc = cfg.compilation_config
    assert cc.mode == CompilationMode.VLLM_COMPILE
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.backend == COMPILER_CLS
    assert cc.cudagraph_capture_sizes and cc.max_cudagraph_capture_size > 0
    assert "all" in cc.custom_ops  # the plugin's ops stay in the compiled pieces
    # No CUDA fusion pass is asked for.
    pc = cc.pass_config
    assert not any(
        getattr(pc, n)
        for n in type(pc).__dataclass_fields__
        if n.startswith("fuse_") or n.endswith("_fusion")
    )
    # Idempotent, as vLLM calls it on every VllmConfig.
    current_platform.check_and_update_config(cfg)
    assert cc.mode == CompilationMode.VLLM_COMPILE
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_optimization_level_o3_compiles_with_graphs(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir, optimization_level=3)
    assert cfg.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert cfg.compilation_config.cudagraph_mode.has_full_cudagraphs()


def test_enforce_eager_turns_graphs_and_compilation_off(tiny_llama_dir):
    cfg = _engine_config(
        tiny_llama_dir,
        enforce_eager=True,
        compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
    )
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_unsupported_compilation_mode_is_one_sentence(tiny_llama_dir):
    cfg = _engine_config(tiny_llama_dir)
    cfg.compilation_config.mode = CompilationMode.STOCK_TORCH_COMPILE
    with pytest.raises(SUPAConfigError) as info:
        current_platform.check_and_update_config(cfg)
    msg = str(info.value)
    assert "STOCK_TORCH_COMPILE" in msg and "VLLM_COMPILE" in msg
    assert msg.endswith(".") and ". " not in msg


# ---- SUPAGraphWrapper on the emulated graph -------------------------------


class _AffineWithHostState(torch.nn.Module):
    """out = x * 2 + offset, where offset is host state read from the forward
    context (like a Python int of the attention plan)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + get_forward_context().additional_kwargs["offset"]


@pytest.fixture
def graph_config(tiny_llama_dir):
    return _engine_config(
        tiny_llama_dir,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    )


def _call(wrapper, x, cfg, mode, offset, num_tokens=4):
    desc = BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens, uniform=True)
    with set_forward_context(
        None,
        cfg,
        cudagraph_runtime_mode=mode,
        batch_descriptor=desc,
    ):
        get_forward_context().additional_kwargs["offset"] = offset
        return wrapper(x)


def test_wrapper_captures_once_then_replays_on_the_static_buffers(graph_config):
    wrapper = SUPAGraphWrapper(_AffineWithHostState(), graph_config, CUDAGraphMode.FULL)
    static = torch.arange(4, dtype=torch.float32)
    before = compilation_counter.num_cudagraph_captured
    set_cudagraph_capturing_enabled(True)
    try:
        out = _call(wrapper, static, graph_config, CUDAGraphMode.FULL, offset=1.0)
    finally:
        set_cudagraph_capturing_enabled(False)
    assert compilation_counter.num_cudagraph_captured == before + 1
    assert torch.equal(out, static * 2 + 1)

    # A runner that copies new inputs into the static buffer gets them.
    static.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    replayed = _call(wrapper, static, graph_config, CUDAGraphMode.FULL, offset=1.0)
    assert torch.equal(replayed, static * 2 + 1)
    assert replayed.data_ptr() == out.data_ptr()  # the static output buffer
    assert compilation_counter.num_cudagraph_captured == before + 1  # reused

    # A runner that forgets the copy gets the stale result: detectably wrong.
    fresh = torch.tensor([5.0, 6.0, 7.0, 8.0])
    stale = _call(wrapper, fresh, graph_config, CUDAGraphMode.FULL, offset=1.0)
    assert not torch.equal(stale, fresh * 2 + 1)
    assert torch.equal(stale, static * 2 + 1)


def test_replay_keeps_the_host_state_of_capture_time(graph_config):
    # On a card a replay re-reads device memory only; emulation matches it by
    # replaying under the capture's forward context.
    wrapper = SUPAGraphWrapper(_AffineWithHostState(), graph_config, CUDAGraphMode.FULL)
    x = torch.ones(4)
    set_cudagraph_capturing_enabled(True)
    try:
        _call(wrapper, x, graph_config, CUDAGraphMode.FULL, offset=1.0)
    finally:
        set_cudagraph_capturing_enabled(False)
    replayed = _call(wrapper, x, graph_config, CUDAGraphMode.FULL, offset=100.0)
    assert torch.equal(replayed, torch.full((4,), 3.0))


def test_wrapper_runs_eagerly_outside_its_mode_and_shares_one_pool(graph_config):
    module = _AffineWithHostState()
    full = SUPAGraphWrapper(module, graph_config, CUDAGraphMode.FULL)
    piecewise = SUPAGraphWrapper(module, graph_config, CUDAGraphMode.PIECEWISE)
    x = torch.ones(4)
    before = compilation_counter.num_cudagraph_captured
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        out = _call(full, x, graph_config, mode, offset=float(mode.value))
        assert torch.equal(out, x * 2 + float(mode.value))
    assert compilation_counter.num_cudagraph_captured == before
    assert not full.concrete_cudagraph_entries
    # Both wrappers (and every capture) use the platform's one pool.
    assert full.graph_pool is piecewise.graph_pool
    assert full.graph_pool is current_platform.get_global_graph_pool()
    set_cudagraph_capturing_enabled(True)
    try:
        _call(full, x, graph_config, CUDAGraphMode.FULL, offset=0.0, num_tokens=4)
        _call(full, x[:2], graph_config, CUDAGraphMode.FULL, offset=0.0, num_tokens=2)
    finally:
        set_cudagraph_capturing_enabled(False)
    graphs = [e.cudagraph for e in full.concrete_cudagraph_entries.values()]
    assert len(graphs) == 2
    assert all(g.pool is full.graph_pool for g in graphs)
    assert all(any(g is h for h in full.graph_pool.graphs) for g in graphs)


def test_capture_outside_the_capture_phase_is_refused(graph_config):
    wrapper = SUPAGraphWrapper(_AffineWithHostState(), graph_config, CUDAGraphMode.FULL)
    with pytest.raises(RuntimeError):
        _call(wrapper, torch.ones(4), graph_config, CUDAGraphMode.FULL, offset=0.0)


# ---- the attention plan a FULL graph keeps --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_plan_stays_right_as_sequences_grow(dtype):
    """A decode batch captured at short sequences and replayed after they
    grew past a block: the capture-time plan (whole block table, masks from
    seq_lens) gives the eager result; a plan sized at capture would not."""
    torch.manual_seed(0)
    block, heads, kv_heads, d, width = 128, 4, 2, 16, 3
    num_reqs = 3
    kv = torch.randn(num_reqs * width, block, kv_heads, 2 * d, dtype=dtype)
    kv_cache = kv.transpose(1, 2)  # LBNHC memory, logical [NB, H, N, 2D]
    block_table = torch.arange(num_reqs * width, dtype=torch.int32).view(
        num_reqs, width
    )
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    query = torch.randn(num_reqs, heads, d, dtype=dtype)
    seq_lens = torch.tensor([5, 60, 100], dtype=torch.int32)  # at capture

    static_plan = make_paged_attention_plan(qsl, None, max_seq_len=width * block)
    static_plan.cache_masks = False
    assert static_plan.decode_max_seq_len == width * block
    sized_plan = make_paged_attention_plan(qsl, seq_lens)  # one block wide
    kwargs = dict(
        scale=1 / math.sqrt(d),
        num_kv_heads=kv_heads,
        max_query_len=1,
        max_seq_len=width * block,
    )
    for plan in (static_plan, sized_plan):  # "capture": both right here
        got = paged_attention(
            query, kv_cache, block_table, seq_lens, qsl, plan=plan, **kwargs
        )
        ref = paged_attention(query, kv_cache, block_table, seq_lens, qsl, **kwargs)
        torch.testing.assert_close(got, ref)

    seq_lens.copy_(torch.tensor([130, 200, 300], dtype=torch.int32))  # in place
    ref = paged_attention(query, kv_cache, block_table, seq_lens, qsl, **kwargs)
    got = paged_attention(
        query, kv_cache, block_table, seq_lens, qsl, plan=static_plan, **kwargs
    )
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, ref, **tol)
    stale = paged_attention(
        query, kv_cache, block_table, seq_lens, qsl, plan=sized_plan, **kwargs
    )
    assert (stale.float() - ref.float()).abs().max() > 0.05


def test_compiler_runs_pieces_eagerly_where_inductor_has_no_device_code(
    monkeypatch,
):
    """A device whose torch_br registers no inductor code generator (the
    stand-in) gets its pieces back as traced, as vLLM's EagerAdaptor does,
    instead of inductor failing at the first lowering."""
    import vllm_br.compilation.compiler as compiler

    class NoCodegen:
        torch_device_type = "supa"

        def has_inductor_codegen(self) -> bool:
            return False

    monkeypatch.setattr(compiler, "get_backend", lambda: NoCodegen())
    graph = torch.fx.symbolic_trace(lambda x: x * 2 + 1)
    compiled, handle = SUPACompiler().compile(graph, [torch.ones(2)], {}, None)
    assert compiled is graph and handle is None
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))


def test_inductor_codegen_is_asked_of_torch_for_the_device():
    from vllm_br.device.base import DeviceBackend
    from vllm_br.device.cpu import CpuBackend

    assert CpuBackend().has_inductor_codegen()
    # Nothing registers a code generator for a PrivateUse1 "supa" device here.
    fake = SimpleNamespace(torch_device_type="supa")
    assert DeviceBackend.has_inductor_codegen(fake) is False
