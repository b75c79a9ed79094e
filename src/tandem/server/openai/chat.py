"""The chat writer: `/v1/chat/completions` answers, whole or as SSE chunks.

Besides text, a chat answer may hold reasoning (split off by the worker's reasoning parser, as
`reasoning` and its older name `reasoning_content`) and tool calls: forced ones (tool_choice
"required" or a named function: the output is their JSON, sent whole at the end) or ones the
worker's tool call parser finds (tool_choice "auto": streamed as the model writes them, text
that may begin a call held back). The finish reason is "tool_calls" when calls answer. With
`echo`, each choice's content opens with the assistant's last message (vLLM's; a chunk of its
own when streamed).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.processor import SequenceDelta
from tandem.pd.text import shown_first_text
from tandem.server.openai.chat_request import ChatCompletionRequest
from tandem.server.openai.writer import Choice, ResponseWriter
from tandem.server.reasoning import split_reasoning, structured_output_start
from tandem.server.tool_calls import calls_so_far, content_end, parse_tool_calls


class ChatWriter(ResponseWriter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    body: ChatCompletionRequest

    def with_response_fields(
        self, response: dict[str, Any], choices: dict[int, Choice]
    ) -> dict[str, Any]:
        """vLLM puts a chat's prompt_logprobs beside its choices (they share the prompt)."""
        return self.with_prompt_logprobs(response, choices[0].prompt_logprobs)

    def logprobs_object(self, logprobs: list) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                dict(entry(item.token_id, item.logprob), top_logprobs=[entry(*t) for t in item.top])
                for item in logprobs
            ]
        }

    def forced_calls(self, text: str) -> list[tuple[str, str]] | None:
        """The (name, arguments) of the calls a forced tool choice's output holds; None when
        it is not complete JSON (cut short by max_tokens)."""
        forced = self.body.forced_tool_calls()
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if forced == "required":
            return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        return [(forced, text)]

    def auto_tool_call_parser(self) -> str | None:
        """The parser that finds this request's tool calls in its text (tool_choice "auto")."""
        return self.settings.tool_call_parser if self.body.auto_tool_choice() else None

    @functools.cached_property
    def is_structured(self) -> bool:
        """A structured output or a forced tool call holds (part of) the answer (an unusable
        one too: the request's params refuse it, a 400)."""
        return self.body.wants_structured_output()

    @functools.cached_property
    def structured_output_after(self) -> int | None:
        """With a reasoning parser, the token after which a structured output or a forced tool
        call holds the answer (the reasoning's end tag: the reasoning before it is free); None
        when there is none to wait for (see `structured_output_start`)."""
        if self.settings.reasoning_parser is None or self.client.tokenizer is None:
            return None
        if not self.is_structured:
            return None
        return structured_output_start(self.client.tokenizer, self.prompt_ids[0])

    @functools.cached_property
    def reasoning_parser(self) -> str | None:
        """The parser that splits this request's reasoning off its content; none for a
        structured output or a forced tool call held from its first token (no reasoning)."""
        if self.settings.reasoning_parser is None:
            return None
        if self.is_structured and self.structured_output_after is None:
            return None  # held from its first token
        return self.settings.reasoning_parser

    def answer(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The message's body (reasoning if split off, content, and the tool calls if any)
        and the finish reason, which is "tool_calls" for tool_choice "required" and for calls
        found with "auto" (as in vLLM)."""
        text, body = choice.text, {}
        if self.reasoning_parser is not None:
            split = split_reasoning(self.reasoning_parser, text, finished=True)
            text = split.content(text) or ""
            if split.reasoning is not None:
                body = {"reasoning": split.reasoning, "reasoning_content": split.reasoning}
        content: str | None = (text or None) if body else text  # null beside reasoning
        calls, finish_reason = None, choice.finish_reason
        if (forced := self.body.forced_tool_calls()) is not None:
            calls = self.forced_calls(text)
            if calls is not None:
                content = None
                if forced == "required" and finish_reason == "stop":
                    finish_reason = "tool_calls"
        elif (parser := self.auto_tool_call_parser()) is not None:
            parsed = parse_tool_calls(parser, text)
            if parsed.calls:
                content, calls, finish_reason = parsed.content, parsed.calls, "tool_calls"
        if calls is None:
            return {**body, "content": content}, finish_reason
        tool_calls = [new_tool_call(name, arguments) for name, arguments in calls]
        return {**body, "content": content, "tool_calls": tool_calls}, finish_reason

    def full_choice(self, index: int, choice: Choice) -> dict[str, Any]:
        body, finish_reason = self.answer(choice)
        if echoed := self.body.echoed_text():
            body["content"] = echoed + (body["content"] or "")
        return {
            "index": index,
            "message": {"role": "assistant", **body},
            "logprobs": self.logprobs_object(choice.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def count_first_chunk(self, choice: Choice, token_id: int, first_text: str) -> None:
        """The router's first chunk holds the prefill answer's message for the first token:
        its reasoning, and its content less the stop-string hold-back (router/chunks.py). The
        same split of the same text here says how much of each the client has."""
        message, _ = self.answer(Choice(text=first_text))
        choice.reasoning_sent = len(message.get("reasoning") or "")
        choice.content_sent = len(shown_first_text(message["content"] or "", self.hold_back))

    async def opening_chunks(self) -> AsyncIterator[dict[str, Any]]:
        yield self.chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(self.n)
            ]
        )
        if echoed := self.body.echoed_text():
            yield self.chunk(
                [
                    {"index": i, "delta": {"content": echoed}, "finish_reason": None}
                    for i in range(self.n)
                ]
            )

    def delta_choice(
        self, index: int, delta: SequenceDelta, choice: Choice
    ) -> dict[str, Any] | None:
        """A chunk, or None when it would say nothing. Forced tool calls go out whole in the
        last chunk; with tool_choice "auto", text that may begin a call is held back, a call
        the parser can stream goes out as the model writes it (its index, id and name first,
        then pieces of its arguments), and the other calls found go out whole in the last chunk.
        With a reasoning parser, the reasoning goes out as `reasoning` (and `reasoning_content`,
        its older name), less what may begin its end tag, and the content after it."""
        body, finish_reason = {"content": delta.text} if delta.text else {}, delta.finish_reason
        forced = self.body.forced_tool_calls() is not None
        parser = self.auto_tool_call_parser()
        if forced or parser is not None or self.reasoning_parser is not None:
            if delta.finish_reason is not None:
                body, finish_reason = self.last_delta(choice)
            elif forced and self.reasoning_parser is None:
                return None
            else:  # a forced call's reasoning streams, its calls wait for the end
                body = self.pieces_so_far(choice, parser, content=not forced)
                says_more = delta.logprobs or (self.body.return_token_ids and delta.token_ids)
                if not body and not says_more:
                    return None
        return {
            "index": index,
            "delta": body,
            "logprobs": self.logprobs_object(delta.logprobs or []),
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def pieces_so_far(
        self, choice: Choice, tool_call_parser: str | None, content: bool = True
    ) -> dict[str, Any]:
        """The reasoning, content (unless held) and tool calls of an unfinished output not sent
        yet, less what may begin the reasoning's end tag or a tool call."""
        text, body = choice.text, {}
        if self.reasoning_parser is not None:
            split = split_reasoning(
                self.reasoning_parser, text, finished=False, known=choice.reasoning_sent
            )
            text = split.content(text) or ""
            if piece := (split.reasoning or "")[choice.reasoning_sent :]:
                body = {"reasoning": piece, "reasoning_content": piece}
                choice.reasoning_sent += len(piece)
        if not content:
            return body
        end = len(text)
        if tool_call_parser is not None:
            end = max(choice.content_sent, content_end(tool_call_parser, text))
        if piece := text[choice.content_sent : end]:
            body["content"] = piece
            choice.content_sent = end
        if tool_call_parser is not None:
            begun = calls_so_far(tool_call_parser, text)
            if calls := self.call_pieces(choice, [(c.name, c.arguments) for c in begun]):
                body["tool_calls"] = calls
        return body

    @staticmethod
    def call_pieces(choice: Choice, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The tool call deltas that bring what was sent of the calls up to `calls` (name,
        arguments so far): a call not begun yet goes out with its index, id, type and name,
        and every call with the arguments not sent yet."""
        pieces, sent = [], choice.arguments_sent
        for index, (name, arguments) in enumerate(calls):
            if index == len(sent):
                pieces.append({"index": index, **new_tool_call(name, arguments)})
                sent.append(len(arguments))
            elif rest := arguments[sent[index] :]:
                pieces.append({"index": index, "function": {"arguments": rest}})
                sent[index] = len(arguments)
        return pieces

    def last_delta(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The last chunk's delta when the output is parsed whole: the reasoning, content and
        tool calls not sent yet (each call with its index), with the finish reason. Calls
        begun while streaming are kept, their arguments finished as written: the output is a
        tool call answer even if the rest of it holds no valid call (finish reason
        "tool_calls", unless a call was cut short)."""
        body, finish_reason = self.answer(choice)
        delta: dict[str, Any] = {}
        if rest := (body.get("reasoning") or "")[choice.reasoning_sent :]:
            delta.update(reasoning=rest, reasoning_content=rest)
        found = [
            (call["function"]["name"], call["function"]["arguments"])
            for call in body.get("tool_calls", [])
        ]
        content, calls = body["content"] or "", found
        if choice.arguments_sent:
            content = choice.text
            if self.reasoning_parser is not None:
                split = split_reasoning(self.reasoning_parser, content, finished=True)
                content = split.content(content) or ""
            parser = self.auto_tool_call_parser()
            begun = calls_so_far(parser, content)
            content = content[: content_end(parser, content)]
            calls = [(call.name, call.arguments) for call in begun] + found[len(begun) :]
            if all(call.complete for call in begun):
                finish_reason = "tool_calls"
        if rest := content[choice.content_sent :]:
            delta["content"] = rest
        if pieces := self.call_pieces(choice, calls):
            delta["tool_calls"] = pieces
        return delta, finish_reason


def new_tool_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call, with an id of its own."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
