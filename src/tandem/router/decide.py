"""Conditional disaggregation: serve a request disaggregated, or whole on its decode worker.

Dynamo's conditional disaggregation and llm-d's decider, on the router's own estimates. The
inputs are the prompt's uncached length (its tokens, less the prefix the chosen decode worker
holds as far as the router knows: the block hashes of the prompts it sent that worker), the
prefill pool's queue (the least tokens waiting among the prefill workers), the decode worker's
own queue (its tokens waiting: prefills it runs itself) and its streams' TPOT p90
(`planner_decode_tpot_high_ms`, the planner's mark, 0: not read). Tokens waiting are a load
report's or, where more, those the router sent and not yet seen prefilled (`queued_tokens`).

    uncached <= max_local_prefill_length (a short prompt)
        whole on the decode worker            short_prompt
        unless its queue > max_prefill_queue_tokens and the prefill queue is shorter:
        disaggregated                         decode_busy
    a longer prompt
        disaggregated                         long_prompt
        unless the prefill queue > max_prefill_queue_tokens, the decode worker's is
        shorter and its streams are under the mark: whole      prefill_queue_full

A long prompt prefilled on a decode worker whose streams are at the TPOT mark would slow them
further (a TPOT SLO missed by all of them); it waits for a prefill worker instead (TTFT pays).

A prompt the router cannot read is disaggregated (`unknown_prompt`), as in the `always` mode.
The router has no tokenizer: a text prompt counts a token per `CHARS_PER_TOKEN` characters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.router.config import RouterConfig
from tandem.router.workers import Worker

CHARS_PER_TOKEN = 4  # English text in the BPE vocabularies of the models served


@dataclass(frozen=True)
class Decision:
    disaggregate: bool
    reason: str

    @property
    def name(self) -> str:
        return "disaggregated" if self.disaggregate else "whole"


def estimated_tokens(units: str | tuple[int, ...], num_units: int) -> int:
    """`num_units` characters (or ids) of `units` as tokens, rounded up."""
    per_token = 1 if isinstance(units, tuple) else CHARS_PER_TOKEN
    return -(-num_units // per_token)


def cached_units(units: str | tuple[int, ...], matched_blocks: int, block_len: int) -> int:
    """The prompt's characters (or ids) in its first `matched_blocks` hashed blocks."""
    return min(len(units), matched_blocks * block_len)


def decide(
    config: RouterConfig,
    uncached_tokens: int | None,
    prefill_workers: Sequence[Worker],
    decode_worker: Worker,
) -> Decision:
    """How to serve a request whose prompt has `uncached_tokens` (None: unknown) on
    `decode_worker`; `prefill_workers` (not empty) are those that could prefill it."""
    if uncached_tokens is None:
        return Decision(True, "unknown_prompt")
    prefill_queue = min(worker.queued_tokens for worker in prefill_workers)
    local_queue = decode_worker.queued_tokens
    limit = config.max_prefill_queue_tokens
    if uncached_tokens <= config.max_local_prefill_length:
        if local_queue > limit and prefill_queue < local_queue:
            return Decision(True, "decode_busy")
        return Decision(False, "short_prompt")
    streams_slowed = config.streams_slowed(decode_worker.load.tpot_p90_ms)
    if prefill_queue > limit and local_queue < prefill_queue and not streams_slowed:
        return Decision(False, "prefill_queue_full")
    return Decision(True, "long_prompt")
