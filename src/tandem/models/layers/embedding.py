"""The token embedding and the LM head, split over the ranks of a tensor-parallel group by
vocabulary rows (vLLM's VocabParallelEmbedding and ParallelLMHead).

    rows per rank = ceil(vocab / size); rank r holds tokens [r * rows, (r + 1) * rows), the last
    rank's rows past the vocabulary zero (padding: never looked up, their logits cut off)

Embedding: each rank looks up the tokens it holds (zeros for the others) and the ranks sum
(all-reduce). LM head: each rank computes its rows' logits, gathered on rank 0 alone, which
samples: `compute` returns None on the other ranks. Both share the partition, so tied
embeddings share one parameter. At size 1 both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.group import TensorParallelGroup
from tandem.distributed.sharding import vocab_rows_per_rank
from tandem.models.layers.linear import (
    CheckpointTensor,
    LinearBase,
    check_shape,
    copy_weight,
    narrow,
)


class VocabRows:
    """This rank's rows of the vocabulary: [start, start + count) real, padded to `rows`."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_size = vocab_size
        self.rows = vocab_rows_per_rank(vocab_size, tp.size)
        self.start = min(tp.rank * self.rows, vocab_size)
        self.count = min(self.rows, vocab_size - self.start)

    def load(self, param: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
        check_shape(loaded_weight, (self.vocab_size, param.shape[1]))
        copy_weight(param[: self.count], narrow(loaded_weight, 0, self.start, self.count))
        param[self.count :].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup.single()
        self.vocab = VocabRows(vocab_size, self.tp)
        self.weight = nn.Parameter(torch.empty(self.vocab.rows, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        self.vocab.load(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab.start
        held = (local_ids >= 0) & (local_ids < self.vocab.count)
        embedded = F.embedding(torch.where(held, local_ids, 0), self.weight)
        return self.tp.all_reduce(embedded * held[:, None].to(embedded.dtype))


class ParallelLMHead(LinearBase):
    """hidden -> logits [T, vocab] on rank 0 (None on the others)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        fused: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup.single()
        self.vocab = VocabRows(vocab_size, tp)
        super().__init__(hidden_size, self.vocab.rows, False, fused, tp)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        self.vocab.load(param, loaded_weight)

    def compute(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_on_first(self.matmul(hidden, None))
        if logits is None or logits.shape[-1] == self.vocab.vocab_size:
            return logits
        return logits[:, : self.vocab.vocab_size]
