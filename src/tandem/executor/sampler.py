"""Token sampling for one step's batch of logits.

The logits first lose the tokens a request's structured output does not allow next (set to
-inf, by the bitmask the scheduler computed: the sampler holds no grammar state), then take each
request's logit_bias and its penalties on the tokens it has seen (presence, frequency,
repetition; see SamplingParams). Then greedy rows take the argmax. Other rows divide by the
temperature, mask by top-k, top-p and min-p, and sample by an exponential race (argmax of
probs / E with E ~ Exp(1)), which equals drawing from the categorical distribution. A seeded
request draws its noise from a generator seeded by (seed, output index), so its token depends on
nothing else in the batch, and a request continued elsewhere (PD decode) draws the same noise
for the same output index.

Logprobs are those of the model's raw distribution (before bias, penalties, temperature and
masks).

The sampler does not wait for the device: its parameters go up from pinned memory without a
wait, and it answers `SampledTokens`, the tokens on the device (the next step may read them
there) with their copy to the host under way; `result()` waits for that copy. (Penalties, whose
steps are never left in flight, still build their counts with a wait.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.outputs import ScheduledRequest, TokenLogprobs
from tandem.engine.structured_output import apply_grammar_bitmasks

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    mixed = (seed * _SEED_MIX + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63
    return torch.Generator(device=device).manual_seed(mixed)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device, without waiting for the work queued there (a plain
    `torch.tensor(values, device=...)` from pageable memory waits for it)."""
    on_cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=True)


class HostCopy:
    """Tensors copied from the device to the host without waiting; `wait()` gives the host
    tensors once the copy (queued after everything before it) is done."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.done = None
        if self.tensors and self.tensors[0].is_cuda:
            self.tensors = [
                torch.empty_like(tensor, device="cpu", pin_memory=True).copy_(
                    tensor, non_blocking=True
                )
                for tensor in self.tensors
            ]
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.tensors


@dataclass
class SampledTokens:
    """A step's samples: the token ids on the device ([rows] int64), their copy to the host
    and that of the logprobs the rows asked for (`result()` waits for them)."""

    token_ids: torch.Tensor
    host: HostCopy
    logprob_rows: list[int]  # the rows that asked for logprobs, and how many top entries each
    logprob_counts: list[int]

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        token_ids, *logprob_parts = self.host.wait()
        token_ids = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprob_rows:
            chosen_ids = [token_ids[row] for row in self.logprob_rows]
            entries = logprob_entries_on_host(chosen_ids, *logprob_parts)
            for row, count, entry in zip(
                self.logprob_rows, self.logprob_counts, entries, strict=True
            ):
                entry.top = entry.top[:count]
                logprobs[row] = entry
        return token_ids, logprobs


class Sampler:
    def __init__(self, eos_token_ids: Collection[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[ScheduledRequest],
    ) -> SampledTokens:
        """logits: [N, vocab] float32, one row per request in `requests`."""
        device = logits.device
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._suppress_early_stops(logits, requests)
        if any(r.grammar_bitmask is not None for r in requests):
            logits = apply_grammar_bitmasks(logits, [r.grammar_bitmask for r in requests])
        params = [r.sampling_params for r in requests]
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, requests)
        if any(p.penalizes_history for p in params):
            logits = self._apply_penalties(logits, requests)

        sampled = logits.argmax(dim=-1)
        if not all(p.is_greedy for p in params):
            greedy = to_device([p.is_greedy for p in params], torch.bool, device)
            temperature = to_device(
                [p.temperature if p.temperature > 0 else 1.0 for p in params], logits.dtype, device
            )
            scaled = self._apply_masks(logits / temperature[:, None], params)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            shared = self._shared_generator(device)
            for row, request in enumerate(requests):
                seed = request.sampling_params.seed
                generator = (
                    shared if seed is None else seeded_generator(seed, request.output_index, device)
                )
                noise[row].exponential_(generator=generator)
            drawn = (probs / noise).argmax(dim=-1)
            sampled = torch.where(greedy, sampled, drawn)

        rows, counts, logprob_parts = [], [], []
        if raw_logprobs is not None:
            rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
            counts = [requests[row].sampling_params.logprobs for row in rows]
            index = to_device(rows, torch.int64, device)
            logprob_parts = logprob_tensors(raw_logprobs[index], sampled[index], max(counts))
        return SampledTokens(sampled, HostCopy([sampled, *logprob_parts]), rows, counts)

    @staticmethod
    @torch.inference_mode()
    def logprobs_of(
        logits: torch.Tensor, token_ids: Sequence[int], count: int
    ) -> list[TokenLogprobs]:
        """The raw logprob of token_ids[i] under row i of logits, its rank and the row's top
        `count` (prompt positions)."""
        raw = torch.log_softmax(logits.float(), dim=-1)
        ids = to_device(token_ids, torch.int64, raw.device)
        return logprob_entries_on_host(
            token_ids, *HostCopy(logprob_tensors(raw, ids, count)).wait()
        )

    def _suppress_early_stops(
        self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop token ids cannot be drawn."""
        rows = [i for i, r in enumerate(requests) if r.output_index < r.sampling_params.min_tokens]
        banned_rows, banned_ids = [], []
        for row in rows:
            params = requests[row].sampling_params
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += self.eos_token_ids
            banned_rows += [row] * len(banned)
            banned_ids += banned
        if not banned_ids:
            return logits
        logits = logits.clone()
        at = (to_device(banned_rows, torch.int64, logits.device),
              to_device(banned_ids, torch.int64, logits.device))  # fmt: skip
        logits.index_put_(at, torch.tensor(float("-inf"), device=logits.device))
        return logits

    @staticmethod
    def _apply_logit_bias(
        logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> torch.Tensor:
        entries = [
            (row, token_id, bias)
            for row, request in enumerate(requests)
            for token_id, bias in request.sampling_params.logit_bias.items()
        ]
        rows, token_ids, biases = zip(*entries, strict=True)
        device = logits.device
        biased = logits.clone()
        biased.index_put_(
            (to_device(rows, torch.int64, device), to_device(token_ids, torch.int64, device)),
            to_device(biases, logits.dtype, device),
            accumulate=True,
        )
        return biased

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor, requests: Sequence[ScheduledRequest]
    ) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.penalizes_history]
        params = [requests[i].sampling_params for i in rows]
        device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device, dtype=dtype)[:, None]

        output_counts = token_counts([requests[i].output_token_ids for i in rows], vocab, device)
        penalized = logits[rows]
        if any(p.repetition_penalty != 1.0 for p in params):
            in_prompt = token_counts([requests[i].prompt_token_ids for i in rows], vocab, device)
            seen = (in_prompt > 0) | (output_counts > 0)
            repetition = column([p.repetition_penalty for p in params])
            scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
            penalized = torch.where(seen, scaled, penalized)
        penalized = (
            penalized
            - column([p.frequency_penalty for p in params]) * output_counts
            - column([p.presence_penalty for p in params]) * (output_counts > 0)
        )
        result = logits.clone()
        result[rows] = penalized
        return result

    @staticmethod
    def _apply_masks(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k == vocab for k in top_k) and all(p == 1.0 for p in top_p) and not any(min_p):
            return logits
        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = ranks >= to_device(top_k, torch.int64, device)[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= cumulative > to_device(top_p, logits.dtype, device)[:, None]
        threshold = sorted_probs[:, :1] * to_device(min_p, logits.dtype, device)[:, None]
        remove |= sorted_probs < threshold
        remove[:, 0] = False  # the most likely token always stays
        masked = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, masked)


def logprob_tensors(
    raw: torch.Tensor, token_ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, ...]:
    """For each row of `raw` (log-softmax values [rows, vocab]), on its device: the logprob of
    token_ids[i], its rank (1: the likeliest), and the row's top `count` ids and logprobs."""
    chosen = raw.gather(1, token_ids[:, None])[:, 0]
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    top_values, top_ids = raw.topk(count, dim=-1)
    return chosen, ranks, top_ids, top_values


def logprob_entries_on_host(token_ids: Sequence[int], *parts: torch.Tensor) -> list[TokenLogprobs]:
    """`logprob_tensors`' parts, on the host, as one entry per row."""
    chosen, ranks, top_ids, top_values = (part.tolist() for part in parts)
    rows = zip(token_ids, chosen, ranks, top_ids, top_values, strict=True)
    return [
        TokenLogprobs(token_id, logprob, list(zip(top, values, strict=True)), rank)
        for token_id, logprob, rank, top, values in rows
    ]


def token_counts(
    sequences: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(sequences), vocab] float32: how often each token id occurs in each sequence."""
    width = max(len(sequence) for sequence in sequences)
    padded = np.full((len(sequences), width + 1), vocab, dtype=np.int64)  # vocab: a spare column
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
    token_ids = torch.from_numpy(padded).to(device)
    counts = torch.zeros(len(sequences), vocab + 1, device=device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))
    return counts[:, :vocab]
