"""Incremental detokenization and stop strings, per request, on the front end.

Text is decoded over a short sliding window of token ids: the delta is the part of
decode(window) beyond decode(window minus the newest tokens). A window ending in an incomplete
UTF-8 sequence (decoded as U+FFFD) emits nothing until the sequence completes, so no broken
character ever leaves. The window starts with the prompt's last tokens, so a tokenizer that
drops a leading space at the start of a text (SentencePiece) still spaces the first output
token right.

Stop strings: the text is cut before the first stop string (after it, with
`include_stop_str_in_output`); while streaming, the last (longest stop string - 1) characters
are held back because they may begin a stop string (nothing is held back when the stop string
stays in the text: all text before its end is output). The hold-back rule lives in
`tandem.pd.text`, shared with the PD flows.
"""

from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams
from tandem.pd.text import stop_hold_back, stop_reach

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text that token_id completes (possibly empty)."""
        if self.tokenizer is None:
            return ""
        self.window.append(token_id)
        prefix_text = self._decode(self.window[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.window[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.window = self.window[self.read_offset :]
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        return delta


class TextState:
    """The text of one output sequence: what is decoded, what was sent, and the stop strings."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.reach = stop_reach(params.stop)
        self.hold_back = stop_hold_back(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.num_sent = 0

    def add_token(self, token_id: int) -> str | None:
        """Decode token_id; returns the stop string it completed, if any (the text is then cut)."""
        before = len(self.text)
        self.text += self.detokenizer.add(token_id)
        if not self.stop:
            return None
        search_from = max(0, before - self.reach)
        found = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        self.text = self.text[: found[0] + (len(found[1]) if self.include_stop else 0)]
        return found[1]

    def take_delta(self, finished: bool) -> str:
        """The text not sent yet; while unfinished, keep back what may start a stop string."""
        end = len(self.text) if finished else max(self.num_sent, len(self.text) - self.hold_back)
        delta = self.text[self.num_sent : end]
        self.num_sent = end
        return delta
