"""The body of `POST /v1/completions` (OpenAI's legacy completions, with vLLM's extensions):
one prompt or a batch of them, echo and the legacy logprobs."""

from __future__ import annotations

from pydantic import Field, field_validator

from tandem.server.openai.protocol import SamplingFields

Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's and vLLM's default here (chat: up to the context)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    add_special_tokens: bool = True  # the tokenizer's BOS and the like before a text prompt
    suffix: str | None = None
    best_of: int | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI's legacy completions)."""
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        counts = [count for count in counts if count is not None]
        return max(counts) if counts else None

    def scores_prompt_only(self) -> bool:
        """echo with max_tokens (or max_completion_tokens, which wins) 0: the answer is the
        prompt (with its logprobs), no token generated (OpenAI's legacy completions;
        lm-evaluation-harness's loglikelihood)."""
        return self.echo and super().engine_max_tokens() == 0

    def engine_max_tokens(self) -> int | None:
        """As vLLM, a prompt scored only runs for one token, which the answer leaves out."""
        return 1 if self.scores_prompt_only() else super().engine_max_tokens()

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (fill in the middle) is not supported; leave it out")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported; use n and pick among the choices")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError(
                "prompt is empty; send a string, a list of token ids or a list of those"
            )
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts this request holds (OpenAI allows a list of prompts)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)
