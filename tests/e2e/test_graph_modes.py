"""Every SUPA graph mode gives eager's greedy output, with captures reused.

Models: the tiny random Qwen3-MoE in every mode and SmolLM2-135M-Instruct
(the default model; slow tier) in the cpu default and FULL_AND_PIECEWISE,
in float32 (identical tokens required), plus the MoE with graphs
and SmolLM2 with the cpu default (compile, no graphs) in bfloat16 under
vLLM's ``check_logprobs_close`` rule. Capture sizes are 1, 2, 4, 8 and
the batches served are 1 and 8 (captured sizes), 3 (padded to 4) and 11
(above the largest: eager). Prompts of 120 and 126 tokens cross the 128-token
block boundary while decoding, so a FULL graph replays over a longer block
table than it was captured with.
"""

from __future__ import annotations

import pytest

from tests.fixtures import standin
from tests.fixtures.engine import (
    check_logprobs_close,
    llm_engine,
    token_ids,
    vllm_logprobs,
)
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _compile_fresh(monkeypatch):
    # Each engine compiles instead of loading an earlier run's artifacts from
    # vLLM's compile cache, so "inductor compiled it" is what is checked.
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")


CAPTURE_SIZES = [1, 2, 4, 8]
BATCHES = [1, 3, 8, 11]
LENGTHS = [120, 5, 40, 300, 17, 60, 9, 126, 33, 70, 12]
MAX_TOKENS = 16
# A small token budget keeps the profile run and the compile quick. Engines
# that compile or capture run in the test process like the eager ones:
# between engines tests/fixtures/engine.py resets what a process exit would
# (dynamo's caches, vLLM's compilation counters, the platform's graph pool),
# so each engine compiles, counts and captures as in a fresh process.
ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512)

# mode -> (compilation mode, cudagraph mode asked for, mode the runner
# serves, runtime modes that hold captured graphs)
MODES = {
    # The cpu backend's default (CpuBackend.default_graph_modes): inductor
    # pieces, no graphs.
    "compile": ("VLLM_COMPILE", "NONE", "NONE", set()),
    "PIECEWISE": ("VLLM_COMPILE", "PIECEWISE", "PIECEWISE", {"PIECEWISE"}),
    "FULL_AND_PIECEWISE": (
        "VLLM_COMPILE",
        "FULL_AND_PIECEWISE",
        "FULL_AND_PIECEWISE",
        {"FULL", "PIECEWISE"},
    ),
    # SUPA attention captures uniform decode batches only, so vLLM's runner
    # serves FULL as FULL_AND_PIECEWISE; the pieces were compiled for FULL
    # (unwrapped), so mixed batches run compiled but without graphs, as on CUDA.
    "FULL": ("VLLM_COMPILE", "FULL", "FULL_AND_PIECEWISE", {"FULL"}),
    # Graphs without compilation: decode batches captured whole.
    "FULL_DECODE_ONLY": ("NONE", "FULL_DECODE_ONLY", "FULL_DECODE_ONLY", {"FULL"}),
}


def graph_facts(worker) -> dict:
    """Runs in the worker (collective_rpc): the graphs it holds."""
    from vllm.compilation.counter import compilation_counter
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.platforms import current_platform

    worker = getattr(worker, "worker", worker)
    wrappers = list(CUDAGraphWrapper._all_instances)
    graphs = [
        e.cudagraph
        for w in wrappers
        for e in w.concrete_cudagraph_entries.values()
        if e.cudagraph is not None
    ]
    pool = current_platform.get_global_graph_pool()
    cc = worker.model_runner.compilation_config
    return {
        "served_mode": cc.cudagraph_mode.name,
        "compile_mode": cc.mode.name,
        "wrapper_types": sorted({type(w).__name__ for w in wrappers}),
        "captured_modes": sorted(
            {w.runtime_mode.name for w in wrappers if w.concrete_cudagraph_entries}
        ),
        "captured": compilation_counter.num_cudagraph_captured,
        "graphs": len(graphs),
        "replays": sum(g.replays for g in graphs),
        # The cpu backend's emulated pool lists its graphs; a torch.supa
        # pool handle is opaque, so there only the identity is checked.
        "one_pool": all(g.pool is pool for g in graphs)
        and len(getattr(pool, "graphs", graphs)) == len(graphs),
        "inductor_compiles": compilation_counter.num_inductor_compiles,
    }


def _params(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


def _serve_batches(llm, prompts, logprobs: int | None = None) -> dict[int, list]:
    from vllm.inputs import TokensPrompt

    out = {}
    for n in BATCHES:
        res = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts[:n]],
            _params(logprobs),
            use_tqdm=False,
        )
        out[n] = vllm_logprobs(res) if logprobs else token_ids(res)
    return out


# SmolLM2 (slow tier, ~60-75 s a mode there) in the cpu backend's default
# and in the mode that captures both kinds of graph; the other modes take the
# same capture and replay paths, checked on the tiny MoE in the default run.
SMOLLM2_MODES = ("compile", "FULL_AND_PIECEWISE")


def _model_modes():
    """Every mode on the tiny MoE in the default run; SmolLM2 in the slow
    tier in SMOLLM2_MODES."""
    for mode in MODES:
        # "compile" captures no graph; on the stand-in (no inductor there) it
        # runs the pieces eagerly, which the eager tests already cover.
        marks = [pytest.mark.cpu_backend] if mode == "compile" else []
        yield pytest.param(
            "tiny_qwen3_moe", mode, marks=marks, id=f"tiny_qwen3_moe-{mode}"
        )
    for mode in SMOLLM2_MODES:
        yield pytest.param(
            "smollm2", mode, marks=[pytest.mark.slow], id=f"smollm2-{mode}"
        )


@pytest.fixture(scope="module")
def eager_run(request):
    """name -> (model dir, prompts, eager outputs), each model's eager engine
    run once per module. A cache, not an indirect parameter: pytest would set
    an indirect fixture up again for every (model, mode) pair."""
    runs = {}

    def get(name: str):
        if name not in runs:
            model_dir = request.getfixturevalue(f"{name}_dir")
            if name == "smollm2":
                from transformers import AutoTokenizer

                prompts = prompt_token_ids_of_lengths(
                    AutoTokenizer.from_pretrained(model_dir), LENGTHS
                )
            else:
                prompts = prompt_token_ids_of_lengths(512, LENGTHS)
            with llm_engine(
                model_dir, dtype="float32", enforce_eager=True, **ENGINE
            ) as llm:
                runs[name] = (model_dir, prompts, _serve_batches(llm, prompts))
        return runs[name]

    return get


@pytest.mark.parametrize("name,mode", list(_model_modes()))
def test_graph_mode_matches_eager_float32(eager_run, name, mode):
    model_dir, prompts, eager = eager_run(name)
    compile_mode, asked, served, captured_modes = MODES[mode]
    config = {
        "mode": compile_mode,
        "cudagraph_mode": asked,
        "cudagraph_capture_sizes": CAPTURE_SIZES,
    }
    with llm_engine(
        model_dir, dtype="float32", compilation_config=config, **ENGINE
    ) as llm:
        start = llm.collective_rpc(graph_facts)[0]
        got = _serve_batches(llm, prompts)
        end = llm.collective_rpc(graph_facts)[0]

    for n in BATCHES:
        assert got[n] == eager[n], f"{name} {mode}: batch {n} differs from eager"
    assert start["served_mode"] == served
    # No graph mode served: vLLM wraps nothing, so no wrapper exists.
    wrappers = ["SUPAGraphWrapper"] if captured_modes else []
    assert start["wrapper_types"] == wrappers
    assert set(start["captured_modes"]) == captured_modes
    if compile_mode == "VLLM_COMPILE" and not standin.active():
        assert start["inductor_compiles"] > 0  # inductor's C++ code generation
    if not captured_modes:
        assert start["graphs"] == end["graphs"] == 0
        return
    assert start["graphs"] > 0 and start["one_pool"]
    # Serving replayed the graphs and captured nothing new.
    assert end["captured"] == start["captured"]
    assert end["graphs"] == start["graphs"]
    assert end["replays"] > start["replays"]


def test_graphs_follow_logprobs_rule_bfloat16(tiny_qwen3_moe_dir):
    prompts = prompt_token_ids_of_lengths(512, LENGTHS)
    config = {
        "mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraph_capture_sizes": CAPTURE_SIZES,
    }
    model = tiny_qwen3_moe_dir
    with llm_engine(model, dtype="bfloat16", enforce_eager=True, **ENGINE) as llm:
        eager = _serve_batches(llm, prompts, logprobs=5)
    with llm_engine(
        model, dtype="bfloat16", compilation_config=config, **ENGINE
    ) as llm:
        graphs = _serve_batches(llm, prompts, logprobs=5)
        assert llm.collective_rpc(graph_facts)[0]["replays"] > 0
    for n in BATCHES:
        check_logprobs_close(eager[n], graphs[n])


@pytest.mark.slow  # two SmolLM2 engines, one compiled (~100 s)
@pytest.mark.skipif(standin.active(), reason=standin.NO_INDUCTOR)
def test_cpu_default_follows_logprobs_rule_bfloat16(smollm2_dir):
    """The configuration a user gets by default (no -cc, no -O, no
    --enforce-eager) on SmolLM2 in bfloat16: compiled pieces whose fused
    bf16 roundings differ from eager's, within vLLM's logprobs rule."""
    from transformers import AutoTokenizer

    prompts = prompt_token_ids_of_lengths(
        AutoTokenizer.from_pretrained(smollm2_dir), LENGTHS
    )
    with llm_engine(smollm2_dir, dtype="bfloat16", enforce_eager=True, **ENGINE) as llm:
        eager = _serve_batches(llm, prompts, logprobs=5)
    with llm_engine(
        smollm2_dir, dtype="bfloat16", enforce_eager=False, **ENGINE
    ) as llm:
        facts = llm.collective_rpc(graph_facts)[0]
        default = _serve_batches(llm, prompts, logprobs=5)
    assert (facts["compile_mode"], facts["served_mode"]) == ("VLLM_COMPILE", "NONE")
    assert facts["inductor_compiles"] > 0
    for n in BATCHES:
        check_logprobs_close(eager[n], default[n])
