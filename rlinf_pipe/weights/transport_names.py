"""The weight transports' names (`runner.weight_sync`), apart from their code: what a run's plan decides before Ray
starts needs no torch."""

from __future__ import annotations

from typing import Literal

Transport = Literal["object_store", "broadcast", "ipc"]
TRANSPORTS: tuple[Transport, ...] = ("object_store", "broadcast", "ipc")


def needs_rendezvous(transport: Transport) -> bool:
    """Whether the transport's members meet in a group (all joining at once) and send and receive at once."""
    return transport in ("broadcast", "ipc")
