"""``GroupWire``: the trainer's side of the engines' bulk weight formats, received by the
fakes' receivers, which follow upstream's unpacking (vLLM 0.33 ``packed_tensor.py``:
``replay_vllm_server.receive_packed``; SGLang 0.5.23 ``tensor_bucket.py``:
``replay_sglang_server.flattened_layout`` / ``receive_flattened``)."""

from __future__ import annotations

import pytest
import torch
from replay_sglang_server import flattened_layout, receive_flattened
from replay_vllm_server import packed_chunks, receive_packed

from asyncflow_core.contracts.errors import WeightSyncError
from asyncflow_core.sync.transports import EngineGroupWeightSync, GroupWire, wire_dtype


def mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("half.odd", torch.randn(3, generator=g).to(torch.float16)),  # 6 bytes
        ("fp32", torch.randn(2, 5, generator=g)),
        ("int8", torch.tensor([7, -3, 1], dtype=torch.int8)),
        ("bf16", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("fp64.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("fp32.strided", torch.randn(4, 3, generator=g).t()),
        ("empty", torch.empty(0, 4)),
    ]


def replay(messages: list[torch.Tensor]) -> object:
    """A broadcast callback for the receiving side: each call gets the next message."""
    queue = list(messages)

    def broadcast(buffer: torch.Tensor) -> None:
        message = queue.pop(0)
        assert buffer.dtype == message.dtype and buffer.shape == message.shape
        buffer.copy_(message)

    return broadcast


def meta(tensors: list[torch.Tensor]) -> tuple[list[str], list[list[int]]]:
    return [wire_dtype(t.dtype) for t in tensors], [list(t.shape) for t in tensors]


@pytest.mark.parametrize("buffer_bytes", [1, 20, 64, 1 << 30])
def test_packed_chunks_are_cut_as_vllm_cuts_them(buffer_bytes: int) -> None:
    names, tensors = GroupWire("packed", buffer_bytes).arrange(*zip(*mixed(), strict=True))
    messages = GroupWire("packed", buffer_bytes).messages(tensors)
    dtypes, shapes = meta(tensors)
    chunks = packed_chunks(dtypes, shapes, buffer_bytes)
    assert len(messages) == len(chunks)  # the receiver expects exactly these broadcasts
    got = receive_packed(replay(messages), names, dtypes, shapes, buffer_bytes)  # type: ignore[arg-type]
    assert [n for n, _ in got] == names
    for (_, back), sent in zip(got, tensors, strict=True):
        assert back.dtype == sent.dtype and torch.equal(back, sent)


def test_flattened_bucket_is_aligned_and_byte_exact() -> None:
    named = mixed()
    natural_dtypes, natural_shapes = meta([t for _, t in named])
    with pytest.raises(ValueError, match="Unaligned received tensor fp32"):
        flattened_layout([n for n, _ in named], natural_dtypes, natural_shapes)  # SGLang's refusal
    wire = GroupWire("flattened")
    names, tensors = wire.arrange([n for n, _ in named], [t for _, t in named])
    assert [t.element_size() for t in tensors] == sorted(
        (t.element_size() for t in tensors), reverse=True
    )
    (message,) = wire.messages(tensors)
    dtypes, shapes = meta(tensors)
    got = receive_flattened(replay([message]), flattened_layout(names, dtypes, shapes))  # type: ignore[arg-type]
    assert [n for n, _ in got] == names
    for (_, back), sent in zip(got, tensors, strict=True):
        assert back.dtype == sent.dtype and torch.equal(back, sent)


def test_bad_wires_are_refused() -> None:
    with pytest.raises(WeightSyncError, match="unknown kind"):
        GroupWire("zip")  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match="packed needs buffer_bytes >= 1"):
        GroupWire("packed")

    class Receiver:
        weight_group_ranks = 1

        def __init__(self, wire: GroupWire) -> None:
            self.weight_wire = wire

        async def join_weight_group(self, *args: object) -> None: ...
        async def begin_weight_update(self) -> None: ...
        async def receive_weights(self, *args: object) -> None: ...
        async def commit_weights(self, version: int) -> None: ...
        async def leave_weight_group(self) -> None: ...

    engines = [Receiver(GroupWire("packed", 10)), Receiver(GroupWire("flattened"))]
    with pytest.raises(WeightSyncError, match="different wire formats"):
        EngineGroupWeightSync(engines, master_address="127.0.0.1", master_port=1)
    one = EngineGroupWeightSync(engines[:1], master_address="127.0.0.1", master_port=1)
    assert one.wire == GroupWire("packed", 10)


def test_packed_unpack_needs_the_alignment_the_wire_gives() -> None:
    """Why the packed wire orders tensors too: vLLM's unpack views a piece at its byte offset,
    which torch refuses when the offset is not a multiple of the element size."""
    named = mixed()
    tensors = [t for _, t in named]
    dtypes, shapes = meta(tensors)
    messages = GroupWire("tensor").messages(tensors)
    flat = [torch.cat([m.contiguous().view(-1).view(torch.uint8) for m in messages])]
    with pytest.raises(RuntimeError, match="storage_offset"):
        receive_packed(replay(flat), [n for n, _ in named], dtypes, shapes, 1 << 30)  # type: ignore[arg-type]
