"""The completion writer: `/v1/completions` answers, whole or as SSE chunks, with OpenAI's
legacy logprobs. With echo each choice opens with its prompt (and, with logprobs, the prompt's
logprobs, the first token's null); echo with max_tokens 0 scores the prompt only, the engine's
one token left out of the answer (as in vLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.processor import SequenceDelta
from tandem.server.engine_client import AsyncEngineClient
from tandem.server.openai.completion_request import CompletionRequest
from tandem.server.openai.writer import Choice, ResponseWriter
from tandem.server.settings import ServerSettings


class CompletionWriter(ResponseWriter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    body: CompletionRequest

    def __init__(
        self,
        client: AsyncEngineClient,
        settings: ServerSettings,
        body: CompletionRequest,
        response_id: str,
        prompts: list[str | list[int]],
        prompt_ids: list[list[int]],
    ) -> None:
        super().__init__(client, settings, body, response_id, prompt_ids)
        self.prompt_texts = [
            p if isinstance(p, str) else client.tokenizer.decode(p) if client.tokenizer else ""
            for p in prompts
        ]
        # echo with max_tokens 0: the engine's one token stays out of the answer (as in vLLM)
        self.prompt_only = body.scores_prompt_only()

    def usage(self, choices: dict[int, Choice], cached: int) -> dict[str, Any]:
        usage = super().usage(choices, cached)
        if self.prompt_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        return super().with_token_ids(choice, [] if self.prompt_only else token_ids)

    def logprobs_object(
        self, logprobs: list, index: int, prompt_logprobs: list | None = None, start: int = 0
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs; with echo, the prompt's tokens come first (the first one
        without a logprob, as nothing predicts it). `start`: the first token's text_offset."""
        if self.body.logprobs is None:
            return None
        rows = [] if self.prompt_only else [(i.token_id, i.logprob, i.top) for i in logprobs]
        if self.body.echo and prompt_logprobs is not None:
            prompt_ids = self.prompt_ids[index // self.n]
            rows[:0] = [(prompt_ids[0], None, None)] + [
                (item.token_id, item.logprob, item.top) for item in prompt_logprobs[1:]
            ]
        tokens, values, tops, offsets = [], [], [], []
        offset = start
        for token_id, logprob, top in rows:
            text = self.token_text(token_id)
            tokens.append(text)
            values.append(logprob)
            top = None if top is None else top[: self.body.logprobs]
            tops.append(None if top is None else {self.token_text(t): lp for t, lp in top})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        prefix = self.prompt_texts[index // self.n] if self.body.echo else ""
        return self.with_prompt_logprobs(
            {
                "index": index,
                "text": prefix + ("" if self.prompt_only else choice.text),
                "logprobs": self.logprobs_object(choice.logprobs, index, choice.prompt_logprobs),
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            },
            choice.prompt_logprobs,
        )

    def count_first_chunk(self, choice: Choice, token_id: int, first_text: str) -> None:
        # the client's first chunk holds the first token's logprobs (a PD decode leg)
        choice.text_offset += len(self.token_text(token_id))

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self.body.echo:
            for prompt_index, text in enumerate(self.prompt_texts):
                for sample in range(self.n):
                    index = prompt_index * self.n + sample
                    yield self.chunk(
                        [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]
                    )

    def delta_choice(self, index: int, delta: SequenceDelta, choice: Choice) -> dict[str, Any]:
        """A chunk; the first one after an echoed prompt carries the prompt's logprobs. Its
        text_offsets go on from the chunks before, so they are the whole answer's."""
        logprobs = self.logprobs_object(
            delta.logprobs or [], index, delta.prompt_logprobs, choice.text_offset
        )
        if logprobs is not None:
            choice.text_offset += sum(map(len, logprobs["tokens"]))
        return self.with_prompt_logprobs(
            {
                "index": index,
                "text": "" if self.prompt_only else delta.text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            },
            delta.prompt_logprobs,
        )
