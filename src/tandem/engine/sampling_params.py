"""Per-request sampling settings, validated once when the request is made.

Invalid values raise `ValueError` with a sentence naming the field and what to change; the HTTP
server turns those into 400 errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tandem.engine.structured_output import StructuredOutput

INT64 = range(-(2**63), 2**63)  # the integers a request carries to the engine (msgpack, torch)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # the stop string, stop token or EOS that ends the output stays in its text (vLLM's)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per sampled token (0: only the sampled one)
    # top-n logprobs of every prompt token after the first (its whole prompt is computed then:
    # no prefix-cache hits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Penalties on tokens already seen, as in OpenAI and vLLM: presence and frequency subtract
    # from the logit of every token generated so far (once, and once per occurrence);
    # repetition (HF/CTRL style) divides positive logits and multiplies negative ones of every
    # token in the prompt or the output. logit_bias is added to the logits of the given ids.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Holds the output to a JSON schema, regex, choice or grammar (structured outputs): all of
    # it, or with `structured_output_after` set, what follows the first such token (a reasoning
    # model's end of reasoning: the reasoning before it is free).
    structured_output: StructuredOutput | None = None
    structured_output_after: int | None = None
    # The prefix cache's namespace (vLLM's cache_salt): a request reuses only the KV of
    # requests with the same salt (one tenant's prompts stay out of another's timing).
    cache_salt: str | None = None
    # Under the priority scheduling policy, lower goes first (vLLM's priority).
    priority: int = 0
    # Whether sampling needs the tokens the request has seen so far (set from the penalties).
    penalizes_history: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.penalizes_history = bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature must be a finite number >= 0",
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1 (no limit), 0 (no limit) or a positive count"),
            (self.top_k in INT64, "top_k must be below 2**63 (0 for no limit)"),
            (self.seed is None or self.seed in INT64, "seed must be from -2**63 to 2**63 - 1"),
            (self.priority in INT64, "priority must be from -2**63 to 2**63 - 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs must be >= 0",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "repetition_penalty must be a finite number > 0 (1 means none)",
            ),
            (
                all(-100 <= bias <= 100 for bias in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (self.cache_salt is None or self.cache_salt != "", "cache_salt must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def with_updates(self, **changes) -> SamplingParams:
        return replace(self, **changes)

    def first_token_only(self) -> SamplingParams:
        """These settings for a PD prefill leg, which samples the first token only: checked
        with the client's limits first, so a leg the decode would refuse is refused here. A
        minimum keeps the first token from ending the request."""
        return replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))
