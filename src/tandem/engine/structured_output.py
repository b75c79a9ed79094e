"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar.

`StructuredOutput` (part of SamplingParams) is what a request asks for; made in the front end, it
compiles the constraint to an llguidance grammar and checks it there, so a bad schema or regex is
the client's error. In the engine, `GrammarBackend` gives each such request a `GrammarMatcher`,
which follows the tokens the request outputs (a PD decode worker's matcher starts by following
the first token its prefill worker sampled) and, before each of its sampling steps, the set of
tokens the grammar allows next (one that allows no token from its start, which no text matches,
is refused there: `UnsatisfiableConstraint`, a 400). A request ends ("stop") as soon as its
grammar is complete. A matcher may wait for a token (the end of a reasoning model's reasoning)
before it holds anything: the outputs up to that token are free, and its grammar starts after it.

The matchers stay with the scheduler: it computes the allowed tokens of each step's sampled rows
as bitmasks (`grammar_bitmasks`), which travel in the `SchedulerOutput` as plain bytes; the
sampler applies them (`apply_grammar_bitmasks`); the scheduler then advances the matchers over
the sampled tokens (`follow_sampled`).

The front end bounds what a constraint may cost before it compiles it (`check_constraint_size`):
its text, and its counted repetitions (`a{1000000}` makes llguidance's lexer spend seconds per
mask, in the engine's step). llguidance's errors are short (no grammar dump): a message that
holds the request's grammar would be as large as it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the bitmasks are applied in the engine; an API process compiles grammars
    import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A regex's (or a grammar's) token: an escape, a character class, a counted repetition, a
# parenthesis, or any other character.
REGEX_TOKEN = re.compile(
    r"\\.|\[(?:\\.|[^\]\\])*\]"
    r"|\{\s*(?P<low>\d*)\s*(?:,\s*(?P<high>\d*)\s*)?\}"  # {n}, {m,}, {m,n}, {,n}
    r"|~\s*(?P<times>\d+)(?:\s*\.\.\s*(?P<upto>\d+))?"  # Lark's ~n and ~m..n
    r"|[()]|.",
    re.S,
)
COUNTS = ("high", "upto", "low", "times")  # a repetition's largest count is the first given


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint: `json` (a JSON schema, as an object or its text), `regex`,
    `choice` (the output is one of these strings), `grammar` (Lark or GBNF), or `json_object`
    (any JSON object). Raises ValueError naming what to change when it is not usable."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON without whitespace beyond ", " and ": " (vLLM's option of that name): a small model
    # let free may write whitespace until max_tokens.
    disable_any_whitespace: bool = False
    # The llguidance grammar it compiles to (what the engine's matcher runs); given only where it
    # was compiled and checked already (the engine process gets it with the request).
    compiled: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if self.compiled is None:
            object.__setattr__(self, "compiled", self._compile(given[0]))

    def _given(self) -> list[str]:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if self.json is False:  # a schema too (one that nothing matches), not an absent one
            given.insert(0, "json")
        return given

    @property
    def kind(self) -> str:
        return self._given()[0]

    def _compile(self, kind: str) -> str:
        import llguidance

        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("the JSON schema must be a JSON object")
        elif kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a list of non-empty strings")
        try:
            if kind == "json":
                compiled = self._compile_json(schema)
            elif kind == "json_object":
                compiled = self._compile_json({"type": "object"})
            elif kind == "choice":
                # One lexeme that matches any of the strings: a rule with one alternative per
                # string would pass llguidance's limit of 2000 items in a parser row.
                alternatives = " | ".join(json.dumps(c) for c in self.choice)
                compiled = llguidance.grammar_from("lark", f"start: CHOICE\nCHOICE: {alternatives}")
            else:
                compiled = llguidance.grammar_from(kind, getattr(self, kind))
            error = llguidance.LLMatcher.validate_grammar(compiled, limits=parser_limits())
        except (ValueError, RuntimeError, TypeError) as exc:  # what llguidance raises on input
            error = str(exc)
        if error:
            raise ValueError(f"the {kind} for structured outputs is not valid: {error.strip()}")
        return compiled

    def _compile_json(self, schema: dict[str, Any] | bool) -> str:
        import llguidance

        overrides = (
            {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            if self.disable_any_whitespace
            else None
        )
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)


def parser_limits() -> Any:
    """llguidance's default limits, with short errors (no dump of the grammar and its state)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def check_constraint_size(constraint: dict[str, Any], max_bytes: int, max_repetition: int) -> None:
    """ValueError saying what to change when a constraint (StructuredOutput's arguments) is
    over the limits: its text (a schema as JSON, a regex, a grammar, a choice's strings
    together) longer than max_bytes, or a counted repetition in it over max_repetition."""
    for kind in ("json", "regex", "grammar", "choice"):
        value = constraint.get(kind)
        if value is None:
            continue
        if kind == "choice":
            text = "".join(c for c in value if isinstance(c, str))
            size = len(text.encode()) + len(value)
        else:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            size = len(text.encode())
        if size > max_bytes:
            raise ValueError(
                f"the {kind} for structured outputs has {size} bytes, over this worker's limit "
                f"of {max_bytes} (--max-structured-output-bytes): send a smaller one"
            )
        repetition = 0 if kind == "choice" else largest_repetition(text)
        if repetition > max_repetition:
            raise ValueError(
                f"the {kind} for structured outputs repeats a part {repetition} times (its "
                f"counted repetitions, nested ones multiplied), over this worker's limit of "
                f"{max_repetition} (--max-structured-output-repetition): use smaller counts, "
                "or * and + for unbounded repetition"
            )


def largest_repetition(text: str) -> int:
    """The largest count a regex's (or a grammar's) counted repetitions give one of its parts:
    `a{5}` 5, `(a{10}|b){20}` 200 (nested counts multiply); 0 without any (`a*` is not
    counted). An upper bound where the text is not a regex (a schema's JSON, a grammar's
    strings)."""
    largest = 0
    inner = [0]  # per open group: the largest repetition inside it so far
    last = 1  # the repetition of the part a quantifier would repeat
    for token in REGEX_TOKEN.finditer(text):
        count = next((token[name] for name in COUNTS if token[name]), None)
        if count is not None:
            last *= int(count)
            inner[-1] = max(inner[-1], last)
            largest = max(largest, last)
        elif token.group() == "(":
            inner.append(0)
            last = 1
        elif token.group() == ")":
            last = max(1, inner.pop() if len(inner) > 1 else 0)
            inner[-1] = max(inner[-1], last)
        else:
            last = 1
    return largest


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, given the outputs so far."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        output_token_ids: list[int],
        after: int | None = None,
    ) -> None:
        self.matcher = matcher  # llguidance's LLMatcher
        self.vocab_size = vocab_size  # the model's: the width of its bitmasks
        self._outputs = output_token_ids  # the request's own list, followed as it grows
        self._num_followed = 0
        self._after = after  # the token the grammar starts after, until it came

    @property
    def active(self) -> bool:
        """The grammar holds the next token (it waits for no token, or that token came)."""
        return self._after is None

    def follow(self) -> None:
        """Advance over the outputs added since the last call (from the awaited token on)."""
        new = self._outputs[self._num_followed :]
        self._num_followed = len(self._outputs)
        if self._after is not None:
            if self._after not in new:
                return
            new = new[new.index(self._after) + 1 :]
            self._after = None
        if new:
            self.matcher.consume_tokens(new)

    def count_sampled(self) -> None:
        """The matcher has consumed a token sampled for this request that the scheduler is
        about to append to its outputs (`follow_sampled`)."""
        self._num_followed += 1

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more (an output that reached this ends there)."""
        return self.active and self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the outputs left the grammar (or it failed to build), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None


class UnsatisfiableConstraint(ValueError):
    """A structured output whose grammar no output of the model's tokens can follow."""


class GrammarBackend:
    """Builds the engine's matchers from the model's tokenizer (given by the front end, which
    loads it anyway, as the tokenizers library's JSON)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_json: str | None = None
        self.eos_token_ids: list[int] = []

    def set_tokenizer(self, tokenizer_json: str, eos_token_ids: Collection[int]) -> None:
        """The tokenizer, and the ids that end a request (a grammar allows them once complete)."""
        self.tokenizer_json = tokenizer_json
        self.eos_token_ids = sorted(eos_token_ids)
        self.__dict__.pop("_tokenizer", None)

    @functools.cached_property
    def _tokenizer(self) -> Any:
        import llguidance

        ids = self.eos_token_ids
        eos = ids[0] if len(ids) == 1 else ids or None  # one id as an int: any version takes it
        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)

    def matcher(
        self, spec: StructuredOutput, output_token_ids: list[int], after: int | None = None
    ) -> GrammarMatcher:
        if self.tokenizer_json is None:
            raise ValueError("structured outputs need the model's tokenizer (a fast tokenizer)")
        import llguidance

        matcher = llguidance.LLMatcher(
            self._tokenizer, spec.compiled, log_level=0, limits=parser_limits()
        )
        matcher.compute_bitmask()  # the first mask: an empty language shows only here
        if matcher.is_error():  # before any token: the grammar leaves no token to write
            raise UnsatisfiableConstraint(
                f"the {spec.kind} for structured outputs matches no text this model can write: "
                "send one that some text matches"
            )
        return GrammarMatcher(matcher, self.vocab_size, output_token_ids, after)


def tokenizer_json(tokenizer: Any) -> str | None:
    """A transformers tokenizer as the tokenizers library's JSON, or None for one without a
    fast (tokenizers) backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


@functools.cache
def _mask_executor() -> Any:
    """llguidance's thread pool, which computes a batch's masks, and advances its grammars, in
    parallel."""
    import llguidance

    return llguidance.LLExecutor()


def follow_sampled(grammars: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> None:
    """Advance each grammar over the token just sampled for it, all at once in llguidance's
    thread pool; the scheduler appends the tokens to the outputs next. The grammars are those
    that gave the step a bitmask (active, and followed the outputs so far)."""
    pairs = zip(grammars, token_ids, strict=True)
    if grammars:
        _mask_executor().consume_token_par(
            [(grammar.matcher, token_id) for grammar, token_id in pairs]
        )
    for grammar in grammars:
        grammar.count_sampled()


def grammar_bitmasks(grammars: Sequence[GrammarMatcher | None]) -> list[bytes | None]:
    """Per row, the tokens its grammar allows next as a bitmask (`ScheduledRequest`'s layout),
    or None for a row without a grammar or whose grammar waits. Each grammar first follows the
    outputs so far. The scheduler's side: the masks of the batch are computed on the host, in
    llguidance's thread pool."""
    for grammar in grammars:
        if grammar is not None:
            grammar.follow()
    bitmasks: list[bytes | None] = [None] * len(grammars)
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.active]
    if not rows:
        return bitmasks
    words = (grammars[rows[0]].vocab_size + 31) // 32
    masks = np.empty((len(rows), words), dtype=np.int32)
    _mask_executor().unsafe_compute_mask_ptr(
        [(grammars[row].matcher, index) for index, row in enumerate(rows)],
        masks.ctypes.data,
        words * masks.itemsize,
        len(rows),
    )
    for index, row in enumerate(rows):
        bitmasks[row] = masks[index].tobytes()
    return bitmasks


def apply_grammar_bitmasks(logits: torch.Tensor, bitmasks: Sequence[bytes | None]) -> torch.Tensor:
    """The logits [rows, vocab] with -inf for the tokens each row's bitmask does not allow
    (rows without one as they are). The executor's side."""
    import torch

    rows = [row for row, bitmask in enumerate(bitmasks) if bitmask is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    packed = bytearray(b"".join(bitmasks[row] for row in rows))
    masks = torch.frombuffer(packed, dtype=torch.int32).view(len(rows), -1)
    words = masks.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (masks.to(logits.device)[:, :, None] >> shifts) & 1
    allowed = bits.view(len(rows), words * 32)[:, :vocab].bool()
    selected = torch.tensor(rows, device=logits.device)
    masked = logits.clone()
    masked[selected] = logits[selected].masked_fill(~allowed, float("-inf"))
    return masked
