"""What a sender records while it packs a version with checksums (every bucket's CRC32 and a fingerprint of a
few tensors by name), and the driver's check of what each receiver loaded against it."""

from __future__ import annotations

import math

from rlinf_pipe.weights.api import LoadedWeights, WeightVersion
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.layout import NamedTensors, WeightLayout

FINGERPRINT_VALUES = 8
FINGERPRINT_MAX_ELEMENTS = 1 << 20  # sglang's get_weights_by_name turns a whole tensor into Python floats first


def fingerprint_names(layout: WeightLayout) -> list[str]:
    """The tensors whose first values make a version's fingerprint: the first, a middle and the last of those with
    at most `FINGERPRINT_MAX_ELEMENTS` values (norms, biases, small projections; all of them if none is that
    small). A receiver reads them back by name, and sglang 0.5.23 converts a whole tensor to a Python list before
    it keeps the first values: an 8B model's embedding would be half a billion floats in its scheduler, each sync."""
    slots = [s for b in layout.buckets for s in b.slots]
    small = [s.name for s in slots if math.prod(s.shape) <= FINGERPRINT_MAX_ELEMENTS] or [s.name for s in slots]
    return list(dict.fromkeys([small[0], small[len(small) // 2], small[-1]]))


class VersionRecord:
    """What a sender learns while it packs a version with checksums: every bucket's CRC32 and the fingerprint."""

    def __init__(self, layout: WeightLayout, checksum: bool):
        self.layout, self.checksum = layout, checksum
        self.crcs: list[int] = []
        self.fingerprint: list[tuple[str, tuple[float, ...]]] = []
        self._wanted = set(fingerprint_names(layout)) if checksum else set()

    def packed(self, views: NamedTensors, crc: int | None) -> None:
        """A bucket was packed: its tensors' `views` into the sent buffer (`tensor_views`), its CRC32 if computed."""
        if crc is not None:
            self.crcs.append(crc)
        for name, view in views:
            if name in self._wanted:
                values = view.reshape(-1)[:FINGERPRINT_VALUES].float().cpu().tolist()
                self.fingerprint.append((name, tuple(values)))

    def version(self, version: int, handles: tuple = ()) -> WeightVersion:
        return WeightVersion(version, self.layout.num_bytes, self.layout.num_tensors, handles, tuple(self.crcs),
                             tuple(self.fingerprint))


def check_loaded(sent: WeightVersion, loaded: LoadedWeights, who: str) -> None:
    """`WeightSyncError` unless `who` loaded exactly what was sent: the version, the byte and tensor counts, and,
    where both sides computed them, the CRC32 of every bucket (a receiver without a trailer to check against, such
    as a torch rank beside SGLang's in one process group, is verified here)."""
    if (loaded.version, loaded.num_bytes, loaded.num_tensors) != (sent.version, sent.num_bytes, sent.num_tensors):
        raise WeightSyncError(
            f"weight sync: {who} loaded version {loaded.version} ({loaded.num_bytes} bytes, {loaded.num_tensors} "
            f"tensors), the actor sent version {sent.version} ({sent.num_bytes} bytes, {sent.num_tensors} tensors)"
        )
    if sent.checksums and loaded.checksums and loaded.checksums != sent.checksums:
        pairs = enumerate(zip(sent.checksums, loaded.checksums, strict=False))
        bad = next((i for i, (a, b) in pairs if a != b), min(len(sent.checksums), len(loaded.checksums)))
        raise WeightSyncError(f"weight sync of version {sent.version}: bucket {bad} that {who} loaded fails its "
                              "CRC32 check against the actor's")
