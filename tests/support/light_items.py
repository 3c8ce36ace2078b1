"""Channel item types without torch: the processes of the channel tests that pass only these never import it
(about 2 s of CPU each on 2 cores, where most of those tests' time went)."""

from __future__ import annotations

import msgspec


class Tagged(msgspec.Struct, frozen=True):
    producer: int
    seq: int
    step: int = 0
