"""Faults a KV server injects into its fetches, for testing the layers above the transport.

`TransportFault` says what to inject; `faulty(server_class, fault)` is a subclass of the TCP KV
server that injects it, through the server's own steps (`_serve_fetch`, `_stream_layers`,
`_send_layer`), so production code carries no fault-injection code. A drop closes the
connection the way a broken network does (an OSError on the connection's thread): the server
reports the broken fetch and the client sees a connection that broke.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TransportFault:
    """drop_after_layers: close the connection after sending that many layers (0: before any;
        the number of layers or more: after every layer, before the confirmation); a hold
        (no layers) is dropped before HELD.
    delay_s: sleep this long before sending the first layer (or HELD).
    times: inject into the first `times` fetches only; None injects into every fetch.
    """

    drop_after_layers: int | None = None
    delay_s: float = 0.0
    times: int | None = None

    def __post_init__(self) -> None:
        if self.drop_after_layers is not None and self.drop_after_layers < 0:
            raise ValueError("drop_after_layers must be >= 0")
        if self.delay_s < 0:
            raise ValueError("delay_s must be >= 0")
        if self.times is not None and self.times < 1:
            raise ValueError("times must be >= 1")

    @classmethod
    def parse(cls, text: str) -> TransportFault:
        """Comma-separated `key:value` items: `drop:N`, `delay:SECONDS`, `times:N`, e.g.
        "drop:1", "delay:5", "delay:0.5,drop:2,times:1"."""
        fields: dict[str, float | int] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                if key == "drop":
                    fields["drop_after_layers"] = int(value)
                elif key == "delay":
                    fields["delay_s"] = float(value)
                elif key == "times":
                    fields["times"] = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"bad transport fault item {item.strip()!r} in {text!r}: "
                    "use drop:LAYERS, delay:SECONDS or times:FETCHES, separated by commas"
                ) from None
        return cls(**fields)


class InjectedDrop(ConnectionAbortedError):
    """The fault's drop: the connection closes as if the network broke it."""


def faulty(server_class: type, fault: TransportFault) -> type:
    """A subclass of `server_class` (the TCP KV server) that injects `fault` into its fetches."""

    class FaultyKVServer(server_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._fault_lock = threading.Lock()
            self._num_faulted = 0
            self._drops: dict[object, int] = {}  # connection -> layers it sends before the drop

        def _take_fault(self) -> TransportFault | None:
            with self._fault_lock:
                if fault.times is not None and self._num_faulted >= fault.times:
                    return None
                self._num_faulted += 1
                return fault

        def _serve_fetch(self, connection, request, header) -> None:
            if request.hold:
                with self._lock:
                    transfer = self._transfers.get(request.transfer_id)
                taken = self._take_fault() if transfer is not None else None
                if taken is not None:
                    self._closing.wait(taken.delay_s)
                    if taken.drop_after_layers is not None:
                        self._report_done(request.transfer_id, transfer, False)
                        raise InjectedDrop("injected drop before HELD")
            super()._serve_fetch(connection, request, header)

        def _stream_layers(self, connection, transfer_id, transfer, sent, header):
            taken = self._take_fault()
            if taken is not None:
                self._closing.wait(taken.delay_s)
                if taken.drop_after_layers is not None:
                    drop_at = min(taken.drop_after_layers, len(transfer.layers))
                    if drop_at == 0:
                        raise InjectedDrop("injected drop before the first layer")
                    self._drops[connection] = drop_at
            try:
                return super()._stream_layers(connection, transfer_id, transfer, sent, header)
            finally:
                self._drops.pop(connection, None)

        def _send_layer(self, connection, index: int, parts) -> None:
            super()._send_layer(connection, index, parts)
            if self._drops.get(connection) == index + 1:
                raise InjectedDrop(f"injected drop after {index + 1} layers")

    return FaultyKVServer
