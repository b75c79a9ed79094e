"""The one orchestration of a PD request's two legs, for the router and the `pd` server alike.

`hand_off` runs the legs in order and owns what both callers must get right the same way:

* the decode leg goes out with the prefill leg (a handoff: it waits on the prefill worker's KV
  server) or once the prefill answered (vLLM's flow, carrying the prefill's lease);
* the first token goes to the client as soon as the prefill has it, its text less the
  stop-string hold-back (`pd.text`), and the decode leg is told so (`first_token_sent`): its
  stream starts after that token, with the decode's detokenizer primed with it, so the splice
  is by token, never by counting characters;
* the prefill's lease is released on every path where the decode leg never took it over.

The legs themselves are `HandoffLegs`: HTTP calls in the router (router/flows.py), engine
client calls in the server (server/pd_client.py). An item is whatever the caller streams
(bytes and a response head in the router, `SequenceDelta`s in the server).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tandem.kv.params import KVTransferParams
from tandem.pd.params import sequential_decode_params
from tandem.pd.text import shown_first_text

Item = TypeVar("Item")


@dataclass(frozen=True)
class FirstToken:
    """The prefill leg's answer: the first token's whole text, the lease its KV is held under
    (None: none was made), and whether the request ends there (the prefill answers it)."""

    text: str
    lease: KVTransferParams | None
    ends_request: bool


class HandoffLegs(Protocol[Item]):
    """One request's two legs, as `hand_off` drives them."""

    # True once the decode leg holds the prefill's lease (it frees it from then on); the legs
    # set it, `hand_off` releases the lease while it is False
    lease_taken: bool

    async def start_prefill(self) -> None:
        """Send the prefill leg (or have `prefill` send it)."""

    async def start_decode(self, params: KVTransferParams) -> None:
        """Send the decode leg with `params`; its answer is awaited later."""

    async def prefill(self) -> FirstToken | Sequence[Item]:
        """The prefill leg's first token, or the whole answer to give instead (a refusal, a
        failure)."""

    def prefill_alone(self, first: FirstToken) -> Sequence[Item]:
        """The answer when the prefill leg is the whole request."""

    async def decode_refused(self) -> Sequence[Item] | None:
        """The answer of a decode leg that refused the request before anything went to the
        client (relayed whole, status and all), else None."""

    def first_token(self, first: FirstToken, shown_text: str) -> Sequence[Item]:
        """What the client gets for the first token, whose text shows as `shown_text`."""

    def continuation(self) -> AsyncGenerator[Item, None]:
        """The decode leg's answer after the first token (the whole answer when the client
        was sent no first token), relayed; failures end it with an error item."""

    async def release(self, lease: KVTransferParams) -> None:
        """Free the prefill's lease (its KV blocks) now."""

    async def close(self) -> None:
        """Finish both legs, giving up one still opening."""


async def hand_off(
    legs: HandoffLegs[Item],
    *,
    hold_back: int,
    handoff: KVTransferParams | None = None,
    first_to_client: bool = True,
) -> AsyncIterator[Item]:
    """The request's answer, item by item. `handoff`: the decode leg's params when it goes out
    with the prefill leg; None: it goes out once the prefill answered, with its lease.
    `first_to_client`: the first token goes out before the decode leg's answer (streams);
    else the decode leg answers whole."""
    lease: KVTransferParams | None = None
    continuation: AsyncGenerator[Item, None] | None = None
    try:
        await legs.start_prefill()  # first: it is on the first token's way
        if handoff is not None:
            await legs.start_decode(handoff)
        first = await legs.prefill()
        if not isinstance(first, FirstToken):
            for item in first:
                yield item
            return
        lease = first.lease
        if first.ends_request or lease is None:
            for item in legs.prefill_alone(first):
                yield item
            return
        if handoff is None:
            await legs.start_decode(sequential_decode_params(lease, first_to_client))
        if first_to_client:
            refusal = await legs.decode_refused()
            if refusal is not None:
                for item in refusal:
                    yield item
                return
            for item in legs.first_token(first, shown_first_text(first.text, hold_back)):
                yield item
        continuation = legs.continuation()
        async for item in continuation:
            yield item
    finally:
        if continuation is not None:  # closed first: a client that left may hand the lease over
            await continuation.aclose()
        await legs.close()
        if lease is not None and not legs.lease_taken:
            await legs.release(lease)
