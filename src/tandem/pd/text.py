"""How much of an unfinished output's text a stream keeps back for the stop strings.

A stream leaves out the last (longest stop string - 1) characters of an unfinished output: they
may begin a stop string that the output then omits. Nothing is held back when the stop string
stays in the output (`include_stop_str_in_output`), since all text before its end goes out.
The engine's detokenizer, the router and the `pd` server all call `stop_hold_back`, so the first
token's text a PD flow sends from the prefill's answer is what the decode worker's detokenizer
counts as sent (docs/protocol.md, "The first token").
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_reach(stop: Sequence[str]) -> int:
    """How many characters before a new token's text a stop string it completes may begin."""
    return max((len(s) for s in stop), default=1) - 1


def stop_hold_back(stop: str | Sequence[str] | None, include_stop_str_in_output: bool) -> int:
    """How many characters an unfinished output keeps back for `stop` (a string, a list of
    them, or None, as a request body gives it)."""
    if include_stop_str_in_output:
        return 0
    return stop_reach([stop] if isinstance(stop, str) else stop or [])


def shown_first_text(text: str, hold_back: int) -> str:
    """The part of the first token's text a stream sends while the output goes on."""
    return text[: max(0, len(text) - hold_back)]
