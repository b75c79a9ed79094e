"""A mixture-of-experts MLP: a top-k router and the experts of one layer, split over the ranks.

    SparseMoeBlock(x) = sum over the token's top-k experts e of  weight_e * expert_e(x)
    expert_e(x)       = down_e(silu(gate_e x) * up_e x)

The router (`gate`, replicated on every rank) takes a softmax over the experts' logits and keeps
the top k; the model's own normalisation follows: Qwen3-MoE divides the k weights by their sum
when its config sets norm_topk_prob, Mixtral always does (a softmax over the top-k logits).

`FusedMoE` holds this rank's experts as two stacked parameters, transformers' own layout:

    gate_up_proj [local experts, 2 * rows, hidden]    [gate rows ; up rows] of each expert
    down_proj    [local experts, hidden, rows]

Without expert parallelism every rank holds every expert, each split by its MLP rows (rows =
intermediate / size: column-parallel gate/up, row-parallel down); with it (`tp.expert_parallel`)
rank r holds experts [r * E / size, (r + 1) * E / size) whole. Either way each rank holds every
token (attention's output projection all-reduced them), computes its part of every expert a
token chose (a rank skips the tokens of experts it does not hold) and one all-reduce sums the
ranks' outputs: the all-gather of the tokens that expert parallelism needs is the one attention
has done already, and the all-reduce is the reduce-scatter plus all-gather of the outputs.

The torch path (any device, the oracle) sorts the (token, expert) pairs by expert once per layer
and runs one matrix product per expert; on CUDA with the fused kernels, a Triton grouped GEMM
(`tandem.models.fused_moe`) does all experts in one launch per projection, with no host sync."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.group import TensorParallelGroup
from tandem.distributed.sharding import HeadRange, even_part
from tandem.models.config import MoEConfig
from tandem.models.layers.linear import CheckpointTensor, check_shape, copy_weight, narrow

GATE, UP = 0, 1  # the halves of gate_up_proj, as a checkpoint's gate_proj / up_proj shard index


class TopKRouter(nn.Module):
    """[T, hidden] -> (routing weights [T, k] float32, expert ids [T, k] int64).

    DeepSeek's variants (`MoEConfig.topk_method`): V2's group_limited_greedy keeps a token's
    experts within its best topk_groups of num_groups groups (a group's score: its best
    expert's); V3's noaux_tc scores by sigmoid, chooses by score + e_score_correction_bias (a
    group's score: its best two) and weights by the score alone; both then scale the weights by
    routed_scaling_factor."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.moe = moe
        if moe.topk_method == "noaux_tc":  # float32, as the checkpoint keeps it
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(moe.num_experts, dtype=torch.float32)
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = F.linear(x, self.weight)
        if moe.scoring == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if moe.topk_method == "greedy":
            weights, expert_ids = scores.topk(moe.top_k, dim=-1)
        else:
            choice = scores
            if moe.topk_method == "noaux_tc":
                choice = scores + self.e_score_correction_bias
            expert_ids = self.group_limited_topk(choice)
            weights = scores.gather(1, expert_ids)
        if moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, expert_ids

    def group_limited_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """The top-k of `choice` [T, experts] among the experts of each token's best groups."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.num_groups, -1)  # [T, groups, per group]
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best_groups = group_scores.topk(moe.topk_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        masked = grouped.masked_fill(~kept[:, :, None], float("-inf")).flatten(1)
        return masked.topk(moe.top_k, dim=-1).indices


def experts_reference(
    x: torch.Tensor,  # [T, hidden]
    gate_up: torch.Tensor,  # [local experts, 2 * rows, hidden]
    down: torch.Tensor,  # [local experts, hidden, rows]
    weights: torch.Tensor,  # [T, k] float32
    expert_ids: torch.Tensor,  # [T, k] global expert ids
    first_expert: int,  # the global id of local expert 0
) -> torch.Tensor:  # [T, hidden]: the local experts' weighted sum
    """The torch path: (token, expert) pairs sorted by expert once, one product per expert."""
    num_tokens, top_k = expert_ids.shape
    num_local = gate_up.shape[0]
    local_ids = expert_ids.flatten() - first_expert  # [T * k]
    held = (local_ids >= 0) & (local_ids < num_local)
    local_ids = torch.where(held, local_ids, num_local)  # other ranks' experts sort last
    order = local_ids.argsort(stable=True)
    counts = torch.bincount(local_ids, minlength=num_local + 1)[:num_local].tolist()
    num_pairs = sum(counts)
    pair_tokens = order[:num_pairs] // top_k  # each held pair's token, sorted by expert
    sorted_x = x[pair_tokens]
    outputs = []
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = sorted_x[start : start + count]
            gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down[expert]))
        start += count
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if outputs:
        pair_weights = weights.flatten()[order[:num_pairs], None]
        out.index_add_(0, pair_tokens, torch.cat(outputs).float() * pair_weights)
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """This rank's experts of one layer (see the module's docstring for the split)."""

    def __init__(
        self, hidden_size: int, moe: MoEConfig, fused: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.fused = fused
        self.hidden_size = hidden_size
        self.intermediate_size = moe.intermediate_size
        if tp.expert_parallel:
            self.experts = even_part(moe.num_experts, tp.rank, tp.size)
            self.rows = HeadRange(0, moe.intermediate_size)
        else:
            self.experts = HeadRange(0, moe.num_experts)
            self.rows = even_part(moe.intermediate_size, tp.rank, tp.size)
        num_local, rows = self.experts.count, self.rows.count
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, rows))
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader

    def checkpoint_shards(self, param: torch.Tensor) -> list[tuple[int, int | None]]:
        """The (expert id, projection) shards that fill `param` on this rank."""
        experts = range(self.experts.start, self.experts.start + self.experts.count)
        projections = (GATE, UP) if param is self.gate_up_proj else (None,)
        return [(expert, projection) for expert in experts for projection in projections]

    def weight_loader(
        self,
        param: torch.Tensor,
        loaded_weight: CheckpointTensor,
        shard_id: tuple[int, int | None],
    ) -> None:
        """Copy this rank's part of one expert's gate_proj, up_proj (shard (expert, GATE | UP))
        or down_proj (shard (expert, None)); another rank's expert is skipped."""
        expert, projection = shard_id
        local = expert - self.experts.start
        if not 0 <= local < self.experts.count:
            return
        rows = self.rows
        if param is self.gate_up_proj:
            check_shape(loaded_weight, (self.intermediate_size, self.hidden_size))
            copy_weight(
                param[local].narrow(0, projection * rows.count, rows.count),
                narrow(loaded_weight, 0, rows.start, rows.count),
            )
        else:
            check_shape(loaded_weight, (self.hidden_size, self.intermediate_size))
            copy_weight(param[local], narrow(loaded_weight, 1, rows.start, rows.count))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """[T, hidden], summed over the ranks."""
        if self.fused:
            from tandem.models import fused_moe

            out = fused_moe.fused_experts(
                x, self.gate_up_proj, self.down_proj, weights, expert_ids, self.experts.start,
                all_experts_local=not self.tp.expert_parallel,
            )  # fmt: skip
        else:
            out = experts_reference(
                x, self.gate_up_proj, self.down_proj, weights, expert_ids, self.experts.start
            )
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP made of experts: the router (`gate`), then the experts."""

    def __init__(
        self, hidden_size: int, moe: MoEConfig, fused: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, moe)
        self.experts = FusedMoE(hidden_size, moe, fused, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids)
