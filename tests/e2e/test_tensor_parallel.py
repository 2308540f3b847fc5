"""Tensor parallelism through vLLM's multiprocessing executor (spawned workers,
gloo on the cpu backend, the plugin's SUPACommunicator in every TP group).

- float32: greedy tokens equal TP=1's, on the tiny Qwen3-MoE at TP=2 (its
  dense layer, attention, the vocab-parallel embedding and LM head split as in
  a dense model, the experts through the plugin's MoE method) and on
  SmolLM2-135M at TP=3 (9 attention heads and 3 KV heads cannot split in two).
- bfloat16 (SmolLM2, TP=3): vLLM's ``check_logprobs_close`` rule against
  TP=1, and ``VLLM_BR_USE_FP32_ALL_REDUCE=1`` measured against it (below).
- A worker killed mid-generation fails the engine, and every engine process
  exits within 60 s.

Data parallelism: vLLM 0.33's offline ``LLM`` refuses ``data_parallel_size >
1``, and its offline SPMD route (``VLLM_DP_SIZE``) refuses dense models; the
last test pins both, so it fails when vLLM opens that path (the server route
is tests/e2e/test_data_parallel.py).

Engines cost most of these tests' time (each spawned process imports vLLM for
~15 s of one core), so the MoE TP=2 engine serves both the float32 test and
the worker-kill test, and one TP=3 bf16 engine serves both allreduce
settings.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import sys
import threading
import time

import pytest

from tests.fixtures import standin
from tests.fixtures.engine import (
    check_logprobs_close,
    llm_engine,
    token_ids,
    vllm_logprobs,
    worker_facts,
)
from tests.fixtures.tiny_models import prompt_token_ids_of_lengths

pytestmark = pytest.mark.e2e

LENGTHS = [1, 129, 40, 7]
MAX_TOKENS = 10
# Small engines: 2 cores run every worker, and the profile run at start-up
# takes max_num_batched_tokens tokens (vLLM's default here: 2048).
SMALL = dict(
    dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512
)
MP = dict(distributed_executor_backend="mp")


def _smollm2_prompts(model_dir, lengths=LENGTHS, seed=0) -> list[list[int]]:
    from transformers import AutoTokenizer

    return prompt_token_ids_of_lengths(
        AutoTokenizer.from_pretrained(model_dir), lengths, seed=seed
    )


def _sampling(max_tokens=MAX_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


def _generate(llm, prompts, params):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)


def _greedy_tokens(llm, prompts) -> list[list[int]]:
    return token_ids(_generate(llm, prompts, _sampling()))


def tp_facts(worker) -> dict:
    """Runs in each worker: the TP group and the communicator serving it."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    comm = group.device_communicator
    return {
        "communicator": type(comm).__name__,
        "world_size": group.world_size,
        "rank_in_group": group.rank_in_group,
        "allreduce": comm.strategy.describe(),
    }


def _assert_tp_engine(llm, tp: int) -> list[dict]:
    facts = llm.collective_rpc(tp_facts)
    assert [f["rank_in_group"] for f in facts] == list(range(tp))
    assert {f["communicator"] for f in facts} == {"SUPACommunicator"}
    assert {f["world_size"] for f in facts} == {tp}
    assert all(f["allreduce"].startswith("SUPA allreduce: ") for f in facts)
    workers = llm.collective_rpc(worker_facts)
    assert {f["platform"] for f in workers} == {"SUPAPlatform"}
    return workers


# ---- the tiny MoE at TP=2: float32 tokens, then a killed worker ------------


class _Engine:
    """One engine shared by the tests of this module, started on first use;
    ``take()`` hands it to a test that breaks it (the next ``get()`` starts a
    fresh one), so the tests do not depend on their order."""

    def __init__(self, stack: contextlib.ExitStack, start):
        self._stack, self._start, self._llm = stack, start, None

    def get(self):
        if self._llm is None:
            self._llm = self._stack.enter_context(self._start())
        return self._llm

    def take(self):
        llm, self._llm = self.get(), None
        return llm


@pytest.fixture(scope="module")
def moe_prompts():
    return prompt_token_ids_of_lengths(512, LENGTHS)


@pytest.fixture(scope="module")
def moe_tp1_tokens(tiny_qwen3_moe_dir, moe_prompts):
    with llm_engine(tiny_qwen3_moe_dir, **SMALL) as llm:
        return _greedy_tokens(llm, moe_prompts)


@contextlib.contextmanager
def _children_output_to(path):
    """Processes started inside write their stdout and stderr to ``path``
    (they inherit file descriptors 1 and 2), so a test can read what an engine
    core and its workers logged."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@pytest.fixture(scope="module")
def moe_tp2(tiny_qwen3_moe_dir, tmp_path_factory):
    """The tiny MoE at TP=2; its processes log to ``moe_tp2.log_path``. On
    exit each engine is shut down and checked for leftover processes
    (llm_engine), a killed one too."""
    log_path = tmp_path_factory.mktemp("moe_tp2") / "engine.log"

    @contextlib.contextmanager
    def start():
        with contextlib.ExitStack() as engine:
            with _children_output_to(log_path):
                llm = engine.enter_context(
                    llm_engine(
                        tiny_qwen3_moe_dir, tensor_parallel_size=2, **MP, **SMALL
                    )
                )
            yield llm

    with contextlib.ExitStack() as stack:
        holder = _Engine(stack, start)
        holder.log_path = log_path
        yield holder


@pytest.mark.slow  # a TP=2 engine in its own processes (~25 s)
def test_moe_float32_tp2_matches_tp1(moe_tp1_tokens, moe_tp2, moe_prompts):
    llm = moe_tp2.get()
    workers = _assert_tp_engine(llm, 2)
    for f in workers:
        assert "SUPAUnquantizedFusedMoEMethod" in f["plugin_layers"]
        assert f["custom_op_dispatch"]["SUPAUnquantizedFusedMoEMethod"] == (
            "forward_oot"
        )
    assert _greedy_tokens(llm, moe_prompts) == moe_tp1_tokens


def _vllm_processes() -> dict[str, object]:
    """This test process's vLLM descendants by process title (vLLM names
    them with setproctitle: VLLM::EngineCore, VLLM::Worker_TP0, ...)."""
    import psutil

    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("VLLM::"):
            found[title.split()[0].removeprefix("VLLM::")] = p
    return found


@pytest.mark.slow  # shares the TP=2 engine above
def test_killed_worker_fails_the_engine_within_60s(moe_tp2, moe_prompts):
    """SIGKILL of TP worker 1 while the engine is generating: the engine core
    reports the failure, the next step raises EngineDeadError, and the
    engine core and both workers are gone within 60 s of the kill."""
    import psutil
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = moe_tp2.take()
    procs = _vllm_processes()
    assert {"EngineCore", "Worker_TP0", "Worker_TP1"} <= set(procs), procs
    engine = llm.llm_engine
    params = _sampling(max_tokens=512 - max(LENGTHS) - 1)
    for i, p in enumerate(moe_prompts):
        engine.add_request(f"long-{i}", TokensPrompt(prompt_token_ids=p), params)
    # Mid-generation: every request has decoded a few tokens, none finished.
    produced: dict[str, int] = {}
    while len(produced) < len(moe_prompts) or min(produced.values()) < 3:
        for out in engine.step():
            assert not out.finished, "generation ended before the kill"
            produced[out.request_id] = len(out.outputs[0].token_ids)

    procs["Worker_TP1"].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    outcome: dict[str, object] = {}

    def drain():
        try:
            while engine.has_unfinished_requests():
                engine.step()
            outcome["finished"] = True
        except Exception as e:  # the engine's report
            outcome["error"] = e

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "no error reached the caller within 60 s"
    assert isinstance(outcome.get("error"), EngineDeadError), outcome
    left = max(0.0, 60 - (time.monotonic() - killed_at))
    _, alive = psutil.wait_procs(list(procs.values()), timeout=left)
    exited_after = time.monotonic() - killed_at
    assert not alive, f"still running 60 s after the kill: {alive}"
    print(f"worker killed: error and exit of every engine process {exited_after:.1f} s")
    # Whichever notices first is reported: the executor's monitor (the dead
    # worker's exit code) or the surviving worker, whose collective with the
    # dead one breaks (gloo: connection reset / closed by peer; SCCL on the
    # stand-in device: the peer exited). The monitor may see the death before
    # the exit code is reaped (None).
    log = moe_tp2.log_path.read_text(errors="replace")
    assert re.search(
        r"Worker proc \S+ died unexpectedly \(exit code: (-9|None)\)"
        r"|Worker failed with error .*(Connection reset by peer|Connection closed by peer)"
        r"|SCCL succl\w+ failed with code \d+: remote process exited",
        log,
    ), log[-3000:]


# ---- SmolLM2 at TP=3 ---------------------------------------------------------


@pytest.mark.slow
def test_smollm2_float32_tp3_matches_tp1(smollm2_dir, monkeypatch):
    standin.ensure_cards(monkeypatch, 3)
    prompts = _smollm2_prompts(smollm2_dir)
    with llm_engine(smollm2_dir, **SMALL) as llm:
        expected = _greedy_tokens(llm, prompts)
    with llm_engine(smollm2_dir, tensor_parallel_size=3, **MP, **SMALL) as llm:
        _assert_tp_engine(llm, 3)
        got = _greedy_tokens(llm, prompts)
    assert got == expected


# bf16 runs the same prompts twice on one engine: no prefix cache hits.
BF16 = dict(
    dtype="bfloat16",
    max_model_len=256,
    max_num_batched_tokens=256,
    max_num_seqs=4,
    enable_prefix_caching=False,
)
BF16_MAX_TOKENS = 8
NUM_LOGPROBS = 5
FP32_REDUCE = "bfloat16 reduced in float32"


def allreduce_probe(worker, fp32_reduce: bool | None = None) -> dict:
    """Runs in each TP worker. Optionally switches the communicator's float32
    reduction (``fp32_reduce``), then all-reduces a bfloat16 tensor of small
    integers (rank r holds seeded tensor r) through the TP group and reports
    whether the result is the exact sum rounded once to bfloat16 (what a
    float32 reduction gives) rather than bfloat16 partial sums rounded again
    at each step."""
    import dataclasses

    import torch
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    comm = group.device_communicator
    if fp32_reduce is not None:
        comm.strategy = dataclasses.replace(comm.strategy, fp32_reduce=fp32_reduce)
    # Integers below 256 are exact in bfloat16 and their sums exact in
    # float32 in any order; sums above 256 are not exact in bfloat16.
    parts = [
        torch.randint(-255, 256, (4096,), generator=torch.Generator().manual_seed(i))
        .float()
        .to(torch.bfloat16)
        for i in range(group.world_size)
    ]
    exact_once = torch.stack(parts).float().sum(0).to(torch.bfloat16)
    reduced = group.all_reduce(parts[group.rank_in_group].clone())
    return {
        "allreduce": comm.strategy.describe(),
        "rounded_once": bool(torch.equal(reduced, exact_once)),
    }


def _logprob_run(llm, prompts):
    """Greedy tokens with their top-k logprobs, and each prompt token's own
    logprob (``prompt_logprobs``: conditioned on the same prompt prefix in
    every engine, so comparable at every position)."""
    outs = _generate(
        llm,
        prompts,
        _sampling(BF16_MAX_TOKENS, logprobs=NUM_LOGPROBS, prompt_logprobs=0),
    )
    prompt_lps = [
        [
            o.prompt_logprobs[pos][tok].logprob
            for pos, tok in enumerate(p)
            if pos > 0  # the first prompt token has no logprob
        ]
        for o, p in zip(outs, prompts, strict=True)
    ]
    return vllm_logprobs(outs), prompt_lps


def _chosen_logprob_diffs(reference, tested) -> tuple[list[float], list[float]]:
    """|logprob difference| of the same token: at every prompt position (the
    same positions in every run), and at each generated step whose prefix
    both runs share (up to where the greedy tokens part)."""
    (ref, ref_prompt), (test, test_prompt) = reference, tested
    at_prompt = [
        abs(a - b)
        for ra, rb in zip(ref_prompt, test_prompt, strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    at_steps = []
    for (ref_ids, ref_steps), (test_ids, test_steps) in zip(ref, test, strict=True):
        for step, (a, b) in enumerate(zip(ref_ids, test_ids, strict=False)):
            if a != b:
                break
            at_steps.append(abs(ref_steps[step][a] - test_steps[step][a]))
    return at_prompt, at_steps


@pytest.mark.slow
def test_bfloat16_tp3_close_to_tp1_and_fp32_allreduce(
    smollm2_dir, monkeypatch, record_property
):
    """bfloat16, TP=3 against TP=1: vLLM's check_logprobs_close rule, with and
    without VLLM_BR_USE_FP32_ALL_REDUCE=1, and the logprob distance to TP=1
    with float32 reduction no larger than without.

    The engine starts with the variable set, so it must reach the spawned
    workers (each reports its strategy, and its TP group reduces a probe
    tensor in float32). The run without it switches the same workers'
    strategy off (``allreduce_probe``): the variable is read only into that
    strategy, and one engine instead of two saves ~90 s.

    Why a margin: each rank's row-parallel output is already rounded to
    bfloat16 before the reduce, and float32 reduction removes only the
    rounding of the partial sums (at TP=3 one of the two; the three rounded
    partials stay). Measured here (~700 positions) it lowers the mean
    distance by ~3%, about one standard error of the paired per-position
    difference, so a strict ``<=`` would flip on another build's matmul
    rounding without any fault: the assertion allows two standard errors
    (float32 reduction is not measurably worse). That it is in effect at all
    is shown exactly by the probe tensor.
    """
    standin.ensure_cards(monkeypatch, 3)
    prompts = _smollm2_prompts(smollm2_dir) + _smollm2_prompts(
        smollm2_dir, [240, 240], seed=5
    )
    with llm_engine(smollm2_dir, **BF16) as llm:
        reference = _logprob_run(llm, prompts)

    monkeypatch.setenv("VLLM_BR_USE_FP32_ALL_REDUCE", "1")
    with llm_engine(smollm2_dir, tensor_parallel_size=3, **MP, **BF16) as llm:
        _assert_tp_engine(llm, 3)
        probe = llm.collective_rpc(allreduce_probe)
        assert all(FP32_REDUCE in f["allreduce"] for f in probe), probe
        assert all(f["rounded_once"] for f in probe), probe
        with_fp32 = _logprob_run(llm, prompts)

        probe = llm.collective_rpc(allreduce_probe, args=(False,))
        assert not any(FP32_REDUCE in f["allreduce"] for f in probe), probe
        # gloo (cpu backend) adds bfloat16 partial sums, rounding each; the
        # stand-in's SCCL accumulates bfloat16 in float32 either way
        # (tests/standin/succl), so there the setting changes no rounding.
        sums_in_fp32 = standin.active()
        assert all(f["rounded_once"] == sums_in_fp32 for f in probe), probe
        without = _logprob_run(llm, prompts)

    check_logprobs_close(reference[0], with_fp32[0])
    check_logprobs_close(reference[0], without[0])
    if not sums_in_fp32:
        assert with_fp32 != without, "float32 reduction changed no logprob"

    prompt_fp32, steps_fp32 = _chosen_logprob_diffs(reference, with_fp32)
    prompt_bf16, steps_bf16 = _chosen_logprob_diffs(reference, without)
    fp32 = statistics.fmean(prompt_fp32 + steps_fp32)
    bf16 = statistics.fmean(prompt_bf16 + steps_bf16)
    # Standard error of the difference of the two means, from the paired
    # per-position differences at the prompt positions.
    paired = [b - a for a, b in zip(prompt_fp32, prompt_bf16, strict=True)]
    se = statistics.stdev(paired) / len(paired) ** 0.5
    record_property("tp3_bf16_logprob_distance_fp32_allreduce", fp32)
    record_property("tp3_bf16_logprob_distance_bf16_allreduce", bf16)
    print(
        f"mean |logprob - TP=1| at TP=3 bf16 over {len(prompt_fp32)} prompt "
        f"positions and {len(steps_fp32)}/{len(steps_bf16)} generated steps: "
        f"fp32 allreduce {fp32:.5f}, bf16 allreduce {bf16:.5f}, standard "
        f"error of the difference {se:.5f}"
    )
    assert fp32 <= bf16 + 2 * se


def test_offline_data_parallel_is_refused_by_vllm(tiny_llama_dir, monkeypatch):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2\) is not supported"):
        LLM(model=str(tiny_llama_dir), data_parallel_size=2)
    monkeypatch.setenv("VLLM_DP_SIZE", "2")
    monkeypatch.setenv("VLLM_DP_RANK", "0")
    monkeypatch.setenv("VLLM_DP_MASTER_IP", "127.0.0.1")
    monkeypatch.setenv("VLLM_DP_MASTER_PORT", "29555")
    with pytest.raises(Exception, match="not supported/useful for dense models"):
        LLM(model=str(tiny_llama_dir), **SMALL)
