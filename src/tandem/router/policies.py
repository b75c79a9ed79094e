"""Which worker of a pool takes a leg: round robin, least outstanding work, or prefix-aware.

A policy sees only the workers that may take the leg now (in the pool, not yet tried for this
request), never an empty list, and returns one of them.

Prefix-aware routing sends a prompt to the worker that most likely holds its prefix in its prefix
cache. The router has no tokenizer, so it cuts the prompt into blocks of `block_len` characters
(or token ids, for token prompts) and hashes them as a chain, each hash covering the whole prefix
up to its block end:

    prompt    |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- tail ->|
    hashes    h0 = H(0, b0)  h1 = H(h0, b1) h2 = H(h1, b2) h3 = H(h2, tail)

A `PrefixIndex` keeps, per worker, an LRU set of the hashes of the prompts it was sent (the
prefill pool has one, the decode pool another: KV-aware decode routing and the conditional
decision's estimate of what a decode worker holds read it). A prompt goes to the worker matching
the longest run of its leading hashes among those with at most `balance_threshold` more requests
in flight than the least loaded one; with no match there, to the least loaded worker. Hashes use
Python's `hash`, which is stable within the router process.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tandem.router.workers import Worker


def prompt_units(endpoint: str, body: dict[str, Any]) -> str | tuple[int, ...] | None:
    """The prompt as a string (or token ids) whose prefixes mirror the worker's cache prefixes.

    None when the body holds no single prompt the router can read (the worker will judge it).
    """
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"{message.get('role')}\n{content}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return tuple(prompt)
    return None


def prefix_hashes(
    units: str | tuple[int, ...] | None, block_len: int, salt: object = None
) -> list[int]:
    """The chained block hashes of a prompt; the last block may be shorter than `block_len`.
    A request's cache salt starts the chain (the workers' caches keep salts apart too)."""
    if not units:
        return []
    hashes = []
    chained = hash(("salt", str(salt))) if salt is not None else 0
    for start in range(0, len(units), block_len):
        chained = hash((chained, units[start : start + block_len]))
        hashes.append(chained)
    return hashes


class PrefixIndex:
    """Per worker, the block hashes of the prompts the router sent it, least recent evicted."""

    def __init__(self, capacity_blocks: int = 1 << 16) -> None:
        self._capacity_blocks = capacity_blocks
        self._cached: dict[str, OrderedDict[int, None]] = {}

    def matched_blocks(self, worker: Worker, prefix: Sequence[int]) -> int:
        """How many of the leading block hashes of `prefix` the worker was sent before."""
        cached = self._cached.get(worker.url)
        if not cached:
            return 0
        matched = 0
        for block_hash in prefix:
            if block_hash not in cached:
                break
            matched += 1
        return matched

    def remember(self, worker: Worker, prefix: Sequence[int]) -> None:
        cached = self._cached.setdefault(worker.url, OrderedDict())
        for block_hash in prefix:
            cached[block_hash] = None
            cached.move_to_end(block_hash)
        while len(cached) > self._capacity_blocks:
            cached.popitem(last=False)


class Policy(ABC):
    uses_prefix: bool = False

    @abstractmethod
    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        """One of `candidates` (never empty); `prefix` is empty unless `uses_prefix`."""


class PinnedPolicy(Policy):
    """For a leg whose worker was already chosen: the one candidate left, no bookkeeping."""

    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        return candidates[0]


class RoundRobinPolicy(Policy):
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        worker = candidates[self._turn % len(candidates)]
        self._turn += 1
        return worker


class LeastOutstandingPolicy(Policy):
    """Fewest requests in flight; ties are taken in turn, so an idle pool is used evenly."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        fewest = min(worker.outstanding for worker in candidates)
        tied = [worker for worker in candidates if worker.outstanding == fewest]
        worker = tied[self._turn % len(tied)]
        self._turn += 1
        return worker


class PreferredPolicy(Policy):
    """The worker chosen beforehand while it may take the leg; else `fallback`'s choice."""

    def __init__(self, preferred: Worker, fallback: Policy) -> None:
        self.preferred = preferred
        self.fallback = fallback

    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        if self.preferred in candidates:
            return self.preferred
        return self.fallback.choose(candidates, prefix)


class PrefixAwarePolicy(Policy):
    uses_prefix = True

    def __init__(self, balance_threshold: int, index: PrefixIndex | None = None) -> None:
        self._balance_threshold = balance_threshold
        self._least_outstanding = LeastOutstandingPolicy()
        self.index = index or PrefixIndex()

    def choose(self, candidates: Sequence[Worker], prefix: Sequence[int]) -> Worker:
        # only workers within the balance threshold of the least loaded one compete on matches
        most = min(worker.outstanding for worker in candidates) + self._balance_threshold
        best, best_matched = None, 0
        for worker in candidates:
            if worker.outstanding > most:
                continue
            matched = self.index.matched_blocks(worker, prefix)
            if matched > best_matched or (
                best is not None
                and matched == best_matched
                and worker.outstanding < best.outstanding
            ):
                best, best_matched = worker, matched
        chosen = best or self._least_outstanding.choose(candidates, prefix)
        self.index.remember(chosen, prefix)
        return chosen


def make_policy(name: str, balance_threshold: int, index: PrefixIndex | None = None) -> Policy:
    """The policy `name`; a prefix-aware one reads and fills `index` (a new one if None)."""
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-outstanding":
        return LeastOutstandingPolicy()
    if name == "prefix-aware":
        return PrefixAwarePolicy(balance_threshold, index)
    raise ValueError(f"unknown routing policy {name!r}")
