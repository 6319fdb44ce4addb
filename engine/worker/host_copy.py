"""Host arrays onto the model's device without stalling it.

On the CPU a numpy array becomes a tensor over the same memory (no copy). On a GPU it is
copied from pinned memory with ``non_blocking=True``: the copy is queued on the stream
behind the work already there, the host goes on at once (a copy from pageable memory makes
the host wait for it), and torch's caching host allocator keeps the pinned buffer until the
copy is done.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (in ``dtype`` if given, converted on the device)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cpu":
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    return tensor if dtype is None else tensor.to(dtype)
