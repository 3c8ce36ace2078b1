"""Opening the two ends of a weight transport by name (`runner.weight_sync`, resolved for the run)."""

from __future__ import annotations

from typing import Any

import torch

from rlinf_pipe.weights.api import WeightReceiver, WeightSender
from rlinf_pipe.weights.layout import WeightLayout, check_layout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transport_names import TRANSPORTS, Transport, needs_rendezvous


def open_sender(transport: Transport, layout: WeightLayout, rendezvous: Rendezvous | None = None) -> WeightSender:
    """The sending end (the actor's gathering rank; rank 0 of a group)."""
    if transport == "object_store":
        from rlinf_pipe.weights.object_store import ObjectStoreSender

        return ObjectStoreSender(layout)
    if transport == "broadcast":
        from rlinf_pipe.weights.process_group import ProcessGroupSender

        return ProcessGroupSender(_required(rendezvous, transport), layout)
    if transport == "ipc":
        from rlinf_pipe.weights.ipc import IpcSender

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return IpcSender(_required(rendezvous, transport), layout, device)
    raise ValueError(f"unknown weight transport {transport!r}; expected one of {TRANSPORTS}")


def open_receiver(
    transport: Transport, layout: WeightLayout, arch: Any, who: str, rendezvous: Rendezvous | None = None,
    rank: int = 1,
) -> WeightReceiver:
    """A receiving end for the sender's `layout`, checked first against this worker's model `arch` (a mismatched
    model fails here, at start-up, naming the first tensor that differs)."""
    check_layout(layout, arch, who)
    if transport == "object_store":
        from rlinf_pipe.weights.object_store import ObjectStoreReceiver

        return ObjectStoreReceiver(layout)
    if transport == "broadcast":
        from rlinf_pipe.weights.process_group import ProcessGroupReceiver

        return ProcessGroupReceiver(_required(rendezvous, transport), rank, layout)
    if transport == "ipc":
        from rlinf_pipe.weights.ipc import IpcReceiver

        return IpcReceiver(_required(rendezvous, transport), rank, layout)
    raise ValueError(f"unknown weight transport {transport!r}; expected one of {TRANSPORTS}")


def _required(rendezvous: Rendezvous | None, transport: str) -> Rendezvous:
    if rendezvous is None:
        raise ValueError(f"the {transport!r} weight transport needs a rendezvous (address, port, members)")
    return rendezvous
