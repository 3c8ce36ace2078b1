"""Item types of the benchmarks (a module Ray workers can import: msgspec Structs must be importable)."""

import msgspec
import numpy as np


class Payload(msgspec.Struct):
    seq: int
    data: np.ndarray
