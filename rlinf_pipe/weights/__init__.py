"""Weight sync: the HF layout plan, bucketing, versions and checksums, and the transports behind one interface.

    layout = plan_weight_layout(arch, dtype, bucket_bytes)                    # both ends agree on it at start-up
    sender = open_sender("broadcast", layout, rendezvous)                     # the actor's gathering rank
    receiver = open_receiver("broadcast", layout, my_arch, "rollout/0", rendezvous, rank=1)
    published = sender.publish(version, policy.hf_weights(), checksum=True)   # -> WeightVersion
    loaded = receiver.receive(published, engine_load_bucket, verify=True)     # -> LoadedWeights

Transports: `object_store` (Ray's object store; `weights.object_store`) and `broadcast` (a process group,
`weights.process_group`). This module and `layout`, `checks`, `api` import neither Ray nor the transports, so
engines may use the layout without them.

The names below load their modules on first use (they import torch); `transport_names` is what a run's plan
needs before Ray starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.weights.api import (
        LoadBucket,
        LoadedWeights,
        WeightReceiver,
        WeightSender,
        WeightVersion,
        publish_whole,
    )
    from rlinf_pipe.weights.checks import WeightSyncError, check_version
    from rlinf_pipe.weights.layout import NamedTensors, WeightLayout, check_layout, plan_weight_layout

_EXPORTS = {
    "LoadBucket": "api", "LoadedWeights": "api", "NamedTensors": "layout", "WeightLayout": "layout",
    "WeightReceiver": "api", "WeightSender": "api", "WeightSyncError": "checks", "WeightVersion": "api",
    "check_layout": "layout", "check_version": "checks", "plan_weight_layout": "layout", "publish_whole": "api",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
