"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, Llama-family decoders (attention, norms,
rotary, embedding and the staged forward of `tandem.models.llama`) whose MLP is experts in the
layers their config names sparse (`tandem.models.layers.moe`).

Parameters keep Hugging Face names, the experts' stacked into transformers' own layout:

    mlp.gate.weight                  the router, [experts, hidden] (Mixtral: block_sparse_moe.gate)
    mlp.experts.gate_up_proj         [local experts, 2 * rows, hidden]  <- experts.E.gate_proj and
                                     up_proj (Mixtral: w1 and w3)
    mlp.experts.down_proj            [local experts, hidden, rows]      <- experts.E.down_proj (w2)

Mixtral's checkpoint names its MLP `block_sparse_moe`, read here as `mlp`. Under expert
parallelism a rank skips the checkpoint tensors of experts it does not hold; the checkpoint
must still give every expert that it holds.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from tandem.models.layers.moe import GATE, UP, FusedMoE, SparseMoeBlock
from tandem.models.llama import LlamaForCausalLM

# an expert's projection in a checkpoint -> (stacked parameter, shard of it)
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", GATE),
    "up_proj": ("gate_up_proj", UP),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", GATE),
    "w3": ("gate_up_proj", UP),
    "w2": ("down_proj", None),
}
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and MixtralForCausalLM: the config says which layers are sparse, how
    many experts a token takes and how their weights are normalised."""

    def build_mlp(self, index: int) -> nn.Module:
        moe = self.config.moe
        if moe is None or index not in moe.sparse_layers:
            return super().build_mlp(index)
        return SparseMoeBlock(self.config.hidden_size, moe, self.fused_ops, self.tp)

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        expert = EXPERT_TENSOR.match(name)
        if expert is None or expert[3] not in EXPERT_PROJECTIONS:
            return super().checkpoint_target(name)
        stacked, projection = EXPERT_PROJECTIONS[expert[3]]
        return f"{expert[1]}.{stacked}", (int(expert[2]), projection)

    def checkpoint_shards(self, name: str, param: nn.Parameter) -> list[Any]:
        owner = self.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, FusedMoE):
            return owner.checkpoint_shards(param)
        return super().checkpoint_shards(name, param)
