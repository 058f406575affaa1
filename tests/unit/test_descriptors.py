"""Descriptor tables (proven in bounds when built) and the vectorised per-request checks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.plan.descriptors import DescTable, UnitCut, checked_block_ids, head_slice_runs, token_cut
from actors.kv.transfer_errors import BlockRangeError, LayoutError
from actors.kv.plan.layout import HND, MLA_ND, NHD


def brute_force(table: DescTable) -> list[tuple[int, int]]:
    """Every descriptor by the documented formula, one by one."""
    c, out = table.cut, []
    for base in table.bases:
        for off, n in c.runs:
            for block in range(table.num_blocks):
                for unit in range(c.units):
                    out.append((base + block * table.block_bytes + unit * c.unit_stride + off, n))
    return out


@settings(max_examples=80, deadline=None)
@given(
    regions=st.integers(1, 3),
    num_blocks=st.integers(1, 5),
    units=st.integers(1, 4),
    unit_stride=st.sampled_from([8, 16, 32]),
    runs=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 8)), min_size=1, max_size=3),
    slack=st.integers(0, 16),
)
def test_rows_expand_to_the_index_formula(regions, num_blocks, units, unit_stride, runs, slack):
    c = UnitCut(units, unit_stride, tuple(runs))
    need = max((units - 1) * unit_stride + o + n for o, n in runs)
    block_bytes = max(need, units * unit_stride) + slack
    bases = tuple(10_000 * (r + 1) for r in range(regions))
    table = DescTable(bases, num_blocks, block_bytes, c)
    addrs, lengths = table.addresses()
    assert list(zip(addrs.tolist(), lengths.tolist())) == brute_force(table)
    assert len(table) == addrs.size
    rows = table.rows()
    # one strided row per (region, run) when units tile the block, else one per block too
    assert rows.shape[0] == regions * len(runs) * (1 if table.tiles_block else num_blocks)
    # the first index of (region, run) is where the formula says
    base = table.region_run_base(np.arange(regions))
    assert base.shape == (regions, len(runs), 1)
    assert int(base[-1, -1, 0]) == ((regions - 1) * len(runs) + len(runs) - 1) * num_blocks * units


def test_a_run_leaving_the_block_is_refused_when_the_table_is_built():
    with pytest.raises(BlockRangeError, match="leaves the 64 B block"):
        DescTable((4096,), 4, 64, UnitCut(2, 32, ((8, 32),)))
    with pytest.raises(BlockRangeError):
        DescTable((4096,), 4, 64, UnitCut(1, 64, ((-1, 8),)))
    with pytest.raises(LayoutError):
        DescTable((4096,), 4, 64, UnitCut(1, 64, ()))
    with pytest.raises(BlockRangeError, match="positive"):
        DescTable((0,), 4, 64, UnitCut(1, 64, ((0, 64),)))


@pytest.mark.parametrize("ids, message", [
    ([0, 1, 2, 99], "remote block id 99 outside"),  # one forged id among good ones
    ([-1, 0], "remote block id -1 outside"),
    ([2**70], "integers"),  # beyond int64
    ([1.5, 2.0], "flat list of integers"),
    (["3"], "flat list of integers"),
    ([True, False], "flat list of integers"),
    ([[1, 2]], "flat list of integers"),
    (np.array([1, 64], dtype=np.int32), "64 outside"),
    (np.array([1, 2], dtype=np.uint64) - np.uint64(2), "outside"),  # wrapped around
])
def test_forged_block_ids_are_refused(ids, message):
    with pytest.raises(BlockRangeError, match=message):
        checked_block_ids("remote", ids, 64)


def test_valid_block_ids_come_back_as_int64():
    ids = checked_block_ids("local", [5, 0, 63], 64)
    assert ids.dtype == np.int64 and ids.tolist() == [5, 0, 63]
    assert checked_block_ids("local", [], 64).size == 0
    big = np.random.default_rng(0).integers(0, 1 << 20, size=200_000)
    assert checked_block_ids("local", big, 1 << 20).size == 200_000


def test_head_slices_by_layout():
    dims = {"H": 4, "N": 2, "D": 8}
    # HND: a head slice is one run per block; the whole head range too
    assert head_slice_runs(HND, dims, dict(dims, H=2), (2, 4), (0, 2), 4) == [(0, 2 * 2 * 8 * 4, 2 * 2 * 8 * 4)]
    assert len(head_slice_runs(HND, dims, dims, (0, 4), (0, 4), 4)) == 1
    # NHD: one run per token slot for a slice, merged into one for the whole block
    assert len(head_slice_runs(NHD, dims, dict(dims, H=2), (2, 4), (0, 2), 4)) == 2
    assert head_slice_runs(NHD, dims, dims, (0, 4), (0, 4), 4) == [(0, 0, 2 * 4 * 8 * 4)]
    with pytest.raises(LayoutError):
        head_slice_runs(HND, dims, dims, (0, 2), (0, 3), 4)


def test_token_cut_is_one_row_per_slot():
    mla = token_cut(MLA_ND, {"N": 16, "D": 576}, 4)
    assert (mla.units, mla.unit_stride, mla.runs) == (16, 576 * 4, ((0, 576 * 4),))
    hnd = token_cut(HND, {"H": 2, "N": 4, "D": 8}, 4)
    assert hnd.runs == ((0, 32), (4 * 8 * 4, 32))  # one row per head
