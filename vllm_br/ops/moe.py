"""Mixture-of-experts: top-k routing and the routed expert MLPs.

Same semantics as vLLM 0.33 (``vllm/model_executor/layers/fused_moe/``):

- ``fused_topk``: ``router/fused_topk_router.py`` ``fused_topk`` (the
  ``topk_softmax`` / ``topk_sigmoid`` kernels: scores over all experts in
  float32, top-k, optional renormalisation) and, with a correction bias,
  ``router/fused_topk_bias_router.py`` ``fused_topk_bias`` (its torch path:
  the bias only chooses, the weights are the unbiased scores, then
  ``routed_scaling_factor``).
- ``grouped_topk``: ``router/grouped_topk_router.py`` ``grouped_topk`` (the
  DeepSeek V2/V3 native path) as ``router/cpu_router.py`` ``_grouped_topk``
  runs it, with the scores in float32.
- ``fused_experts``: what ``UnquantizedFusedMoEMethod`` computes:
  ``w13`` is ``[E, 2I, H]`` with the gate rows first, then the up rows
  (``RoutedExperts._load_w13``), ``w2`` is ``[E, H, I]``, and each token's
  output is ``sum_k w_k * w2[e_k] @ act(w13[e_k] @ x)``. Expert ids outside
  ``[0, E)`` (``-1``: a padding row, or an expert on another EP rank) add
  nothing.

With int8 experts (``w13_scale`` ``[E, 2I]`` and ``w2_scale`` ``[E, H]``
given: per-output-channel scales of int8 ``w13`` / ``w2``), each expert's
weight is ``q * scale``, dequantized in float32 and rounded once to the
activation dtype for the experts a call reads; with ``quantize_activations``
(W8A8) each GEMM's input rows are quantized to int8 per token first
(``quantize_int8``) and dequantized, which is what an int8 x int8 GEMM with
those scales computes, up to the rounding of its float sums. Weight-only
experts (W8A16, W4A16, GPTQ) take the scales per group ``[E, rows, groups]``,
optional int8 zero points of the same shape and ``weight_bits`` 4 for int4
packed two per byte (``vllm_br.ops.quant``): ``w = (q - zero) * scale``.

``fused_experts`` has two paths with the same result up to rounding. Up to
``VLLM_BR_STATIC_MOE_DECODER_MAX_LEN`` tokens (decode batches) every shape
depends only on the token count, so a SUPA graph can capture it; larger
batches group tokens by expert and run one GEMM per expert that has tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_br import envs
from vllm_br.ops.activation import gelu_and_mul, silu_and_mul
from vllm_br.ops.quant import quantize_int8, unpack_int4
from vllm_br.ops.registry import register_op

# vLLM's MoEActivation values (fused_moe/activation.py) that we compute; the
# gated ones take [..., 2I] (gate first) and return [..., I].
ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu": lambda x: gelu_and_mul(x, "none"),
    "gelu_tanh": lambda x: gelu_and_mul(x, "tanh"),
    "silu_no_mul": F.silu,
    "gelu_no_mul": F.gelu,
    "gelu_tanh_no_mul": lambda x: F.gelu(x, approximate="tanh"),
    "relu2_no_mul": lambda x: torch.square(F.relu(x)),
}


def _scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"unsupported MoE scoring function {scoring_func!r}")


def _finish(
    weights: torch.Tensor, ids: torch.Tensor, renormalize: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights.float(), ids.to(torch.int32)


@register_op("fused_topk")
def fused_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [N, k], topk_ids int32 [N, k])``."""
    scores = _scores(router_logits, scoring_func)
    if e_score_correction_bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
        ids = torch.topk(choice, top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    return _finish(weights, ids, renormalize, routed_scaling_factor)


@register_op("grouped_topk")
def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: keep the ``topk_group`` best of ``num_expert_group``
    expert groups (a group scores its best expert, or with a correction bias
    its best two, on the biased scores), then top-k inside them."""
    n, num_experts = router_logits.shape
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"{num_experts} experts do not split into {num_expert_group} groups"
        )
    per_group = num_experts // num_expert_group
    scores = _scores(router_logits, scoring_func)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    grouped = choice.view(n, num_expert_group, per_group)
    if e_score_correction_bias is None:
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(n, num_expert_group, per_group)
    choice = choice.masked_fill(~expert_mask.reshape(n, num_experts), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    return _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor)


def _act(activation: str):
    fn = ACTIVATIONS.get(activation)
    if fn is None:
        raise ValueError(f"unsupported MoE activation {activation!r}")
    return fn


class _Experts:
    """One expert weight stack ``[E, rows, cols]``: plain, or quantized
    (int8, or int4 packed two per byte as ``vllm_br.ops.quant`` stores it)
    with scales per row ``[E, rows]`` or per group ``[E, rows, groups]`` and
    optional int8 zero points shaped like the grouped scales; quantized
    experts are dequantized in float32 for the experts a path reads and
    rounded once to the activation dtype."""

    def __init__(
        self,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        dtype: torch.dtype,
        zero_point: torch.Tensor | None = None,
        bits: int = 8,
    ) -> None:
        self.w, self.scale, self.zero_point = w, scale, zero_point
        self.bits, self.dtype = bits, dtype
        self.num = w.shape[0]

    def _deq(self, ids) -> torch.Tensor:
        w = self.w[ids]
        if self.scale is None:
            return w
        q = unpack_int4(w) if self.bits == 4 else w
        rows, cols = q.shape[-2:]
        scale = self.scale[ids].to(torch.float32).reshape(*q.shape[:-2], rows, -1)
        groups = scale.shape[-1]
        wf = q.to(torch.float32).reshape(*q.shape[:-1], groups, cols // groups)
        if self.zero_point is not None:
            zero = self.zero_point[ids].to(torch.float32)
            wf = wf - zero.reshape(*scale.shape).unsqueeze(-1)
        return (wf * scale.unsqueeze(-1)).reshape(q.shape).to(self.dtype)

    def select(self, ids: torch.Tensor) -> torch.Tensor:
        return self._deq(ids)

    def all(self) -> torch.Tensor:
        return self._deq(slice(None))

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._deq(e)

    @property
    def rows(self) -> int:
        return self.w.shape[1]


def _qdq(x: torch.Tensor) -> torch.Tensor:
    """Rows quantized to int8 per token and back: a W8A8 GEMM's input."""
    q, s, _ = quantize_int8(x.reshape(-1, x.shape[-1]))
    return (q.to(torch.float32) * s).to(x.dtype).view(x.shape)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _static_gather(x, w13, w2, weights, ids, act, pre) -> torch.Tensor:
    """Few routed slots (N*k <= E): each slot gathers its expert's weights
    and runs a batched matrix-vector product."""
    (n, k), hidden = ids.shape, x.shape[-1]
    flat_ids = ids.reshape(-1)
    slots = pre(x).unsqueeze(1).expand(n, k, hidden).reshape(n * k, hidden, 1)
    h = torch.bmm(w13.select(flat_ids), slots).squeeze(-1)
    y = torch.bmm(w2.select(flat_ids), pre(act(h)).unsqueeze(-1)).squeeze(-1)
    return (y.float() * weights.reshape(-1, 1)).view(n, k, y.shape[-1]).sum(dim=1)


def _static_dense(x, w13, w2, weights, ids, act, pre) -> torch.Tensor:
    """Many slots (N*k > E): every expert on every token, each weight read
    once, combined with a dense [N, E] weight matrix (zero where unrouted)."""
    h = torch.matmul(pre(x).unsqueeze(0), w13.all().transpose(1, 2))  # [E, N, 2I]
    y = torch.matmul(pre(act(h)), w2.all().transpose(1, 2))  # [E, N, H]
    dense = torch.zeros(x.shape[0], w13.num, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids.long(), weights)
    return torch.einsum("ne,enh->nh", dense, y.float())


def _dynamic(x, w13, w2, weights, ids, act, valid, pre) -> torch.Tensor:
    """Slots sorted by expert; one GEMM per expert that received tokens."""
    num_experts = w13.num
    k = ids.shape[1]
    flat_ids = torch.where(valid, ids, num_experts).reshape(-1)  # dropped: last
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // k
    slot_weights = weights.reshape(-1)[order].unsqueeze(-1)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts]
    out = torch.zeros(x.shape[0], w2.rows, dtype=torch.float32, device=x.device)
    xq = pre(x)
    start = 0
    for e, count in enumerate(counts.tolist()):  # one host sync per call
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tok = tokens[rows]
        h = act(xq.index_select(0, tok) @ w13[e].t())
        y = pre(h) @ w2[e].t()
        out.index_add_(0, tok, y.float() * slot_weights[rows])
    return out


@register_op("fused_experts")
def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    static_max_tokens: int | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    quantize_activations: bool = False,
    w13_zero_point: torch.Tensor | None = None,
    w2_zero_point: torch.Tensor | None = None,
    weight_bits: int = 8,
) -> torch.Tensor:
    """Routed experts for ``hidden_states [N, H]``; returns ``[N, H]`` in its
    dtype. GEMMs and the activation run in that dtype, the weighted sum over
    experts in float32. ``expert_map`` maps global expert ids to local ones
    (-1: not on this rank). ``static_max_tokens`` overrides
    ``VLLM_BR_STATIC_MOE_DECODER_MAX_LEN``. ``w13_scale`` / ``w2_scale`` and
    ``quantize_activations``: int8 experts; with ``w13_zero_point`` /
    ``w2_zero_point`` and ``weight_bits``: weight-only int8 / int4 experts
    (module docstring)."""
    act = _act(activation)
    x = hidden_states
    pre = _qdq if quantize_activations else _same
    w13 = _Experts(w13, w13_scale, x.dtype, w13_zero_point, weight_bits)
    w2 = _Experts(w2, w2_scale, x.dtype, w2_zero_point, weight_bits)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map[ids.clamp(min=0)].long(), -1)
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        # vLLM's kernels allow this only for top-1 (Llama 4): scale the input.
        if ids.shape[1] != 1:
            raise ValueError("apply_router_weight_on_input needs top_k == 1")
        x = (x.float() * weights).to(x.dtype)
        weights = torch.ones_like(weights)
    valid = (ids >= 0) & (ids < w13.num)
    limit = (
        envs.VLLM_BR_STATIC_MOE_DECODER_MAX_LEN
        if static_max_tokens is None
        else static_max_tokens
    )
    if x.shape[0] <= limit:
        weights = torch.where(valid, weights, 0.0)
        ids = torch.where(valid, ids, 0)  # a dropped slot: expert 0, weight 0
        static = _static_gather if ids.numel() <= w13.num else _static_dense
        out = static(x, w13, w2, weights, ids, act, pre)
    else:
        out = _dynamic(x, w13, w2, weights, ids, act, valid, pre)
    return out.to(hidden_states.dtype)
