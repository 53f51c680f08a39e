"""Batches built from a few large pieces (``Rows``): the Ray store's reader hands
``assemble_batch`` the rows of a field as views of a few packed columns, and a padded (equal
rows) or nested field is then copied piece by piece. The answer must be exactly the one of a
row-by-row copy, whatever the routing of rows to units, and a column whose rows do not tile
its pieces falls back to the row-by-row copy."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from asyncflow_core.contracts.protocols import BatchMeta, FieldSchema
from asyncflow_core.data.store import _JAGGED, Rows, assemble_batch

pytest.importorskip("ray", reason="asyncflow_ray needs the [ray] extra")

from asyncflow_ray.store import batch_pieces, merge_by_unit


def unit_rows(lengths: list[list[int]], trailing: tuple[int, ...] = ()) -> Rows:
    """One unit's column: per segment, rows of the given lengths viewing one flat tensor."""
    rows, pieces = [], []
    for seg in lengths:
        flat = torch.randn(sum(seg) * max(1, torch.Size(trailing).numel()))
        pieces.append(flat)
        at = 0
        for n in seg:
            k = n * torch.Size(trailing).numel()
            rows.append(flat[at : at + k].view(n, *trailing))
            at += k
    return Rows(rows, pieces)


def meta(n: int) -> BatchMeta:
    return BatchMeta(partition="p", task="t", rows=tuple(range(n)), fields=("x",))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("layout", ["nested", "padded"])
def test_merged_pieces_build_the_same_batch_as_row_by_row(seed: int, layout: str) -> None:
    rnd = random.Random(seed)
    n_units, block = rnd.choice([(1, 4), (2, 3), (3, 2), (2, 32)])
    trailing = rnd.choice([(), (3,)])
    equal = layout == "padded"
    n = rnd.randint(1, 40)
    order = [(r // block) % n_units for r in range(n)]
    counts = [order.count(u) for u in range(n_units)]

    def length() -> int:
        return 5 if equal else rnd.choice([0, 1, 2, 7])

    cols = []
    for c in counts:  # each unit's rows in a random number of segments
        cuts = sorted(rnd.sample(range(1, c), min(c - 1, rnd.randint(0, 3)))) if c > 1 else []
        segs = [[length() for _ in range(b - a)] for a, b in itertools.pairwise([0, *cuts, c])]
        cols.append(unit_rows([s for s in segs if s], trailing))
    got = merge_by_unit(list(range(n)), [{"x": c} for c in cols], ["x"], block)["x"]
    assert type(got) is Rows
    plain = list(got)
    assert torch.equal(
        torch.cat([p.reshape(-1) for p in got.pieces]),
        torch.cat([t.reshape(-1) for t in plain]),
    )
    assert len(got.pieces) <= len(plain)
    schema = FieldSchema(dtype="float32", ndim=1 + len(trailing))
    fast = assemble_batch(meta(n), ["x"], {"x": schema}, {"x": got}, layout, 0)
    slow = assemble_batch(meta(n), ["x"], {"x": schema}, {"x": plain}, layout, 0)
    for a, b in zip(fast["x"].unbind(), slow["x"].unbind(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast.lengths["x"], slow.lengths["x"])


def test_consecutive_rows_of_one_piece_are_one_copy() -> None:
    col = unit_rows([[4, 4, 4, 4]])
    pieces = batch_pieces([0, 0, 0, 0], [col])
    assert pieces is not None and len(pieces) == 1
    assert pieces[0].data_ptr() == col.pieces[0].data_ptr()  # a view, not a copy


def test_rows_that_do_not_tile_their_pieces_fall_back_to_row_by_row() -> None:
    col = unit_rows([[3, 3]])
    bad = Rows(list(col), [col.pieces[0][:4]])  # pieces shorter than the rows
    assert batch_pieces([0, 0], [bad]) is None
    got = merge_by_unit([0, 1], [{"x": bad}], ["x"], 32)["x"]
    assert type(got) is list and all(a is b for a, b in zip(got, col, strict=True))


def test_a_list_layout_batch_holds_a_plain_list() -> None:
    col = unit_rows([[2, 3]])
    schema = FieldSchema(dtype="float32", ndim=1)
    batch = assemble_batch(meta(2), ["x"], {"x": schema}, {"x": col}, "list", 0)
    assert type(batch["x"]) is list


def test_the_fast_jagged_builder_matches_torch_s_own() -> None:
    rows = [torch.randn(2, 3), torch.randn(0, 3), torch.randn(5, 3)]
    values = torch.cat(rows)
    offsets = torch.tensor([0, 2, 2, 7])
    got = _JAGGED(values, offsets, 0, 5)
    want = torch.nested.nested_tensor(rows, layout=torch.jagged)
    assert type(got) is type(want) and got.dim() == want.dim() == 3
    for a, b in zip(got.unbind(), want.unbind(), strict=True):
        assert torch.equal(a, b)
    assert got._values is values  # type: ignore[attr-defined]  # no copy
