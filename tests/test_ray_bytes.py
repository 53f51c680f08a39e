"""``asyncflow_ray.runtime.tensor_bytes`` / ``bytes_tensor``: a tensor's bytes as a numpy view
for Ray's object store and back, for every layout a caller may hand in (no Ray cluster)."""

from __future__ import annotations

import pytest
import torch
from asyncflow_ray.runtime import bytes_tensor, tensor_bytes

LAYOUTS = {
    "contiguous": lambda: torch.arange(6.0).view(2, 3),
    "transposed": lambda: torch.arange(6.0).view(2, 3).t(),
    "one-of-a-strided-slice": lambda: torch.arange(3.0)[1:3:2],  # stride 2, one element
    "strided": lambda: torch.arange(10, dtype=torch.int64)[::3],
    "0-dim": lambda: torch.tensor(2.5, dtype=torch.float64),
    "empty": lambda: torch.zeros(0, 4),
    "bool": lambda: torch.tensor([True, False, True]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_bytes_round_trips_every_layout(layout: str) -> None:
    t = LAYOUTS[layout]()
    data = tensor_bytes(t)
    back = bytes_tensor(data, str(t.dtype).removeprefix("torch."), copy=True)
    assert torch.equal(back, t.reshape(-1))
