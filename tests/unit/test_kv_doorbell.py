"""kv_transfer.doorbell's host side, which needs no GPU: where a page's words are, the shared memory both
processes map (a write through one mapping is seen through the other), and the receiver's slot table (a slot
whose lease ended unclaimed rests before it is handed out again, generations only grow)."""

from __future__ import annotations

import itertools

import pytest

from kv_transfer.config import TransferConfig
from kv_transfer.doorbell import (
    ALL_LAYERS,
    BELL_STEP,
    LINE_WORDS,
    MAX_GENERATION,
    QUARANTINE_S,
    Geometry,
    Page,
    SlotTable,
    bell_value,
)
from model_runtime.config import ConfigError

pytestmark = pytest.mark.unit


def test_words_do_not_overlap_and_bells_sit_on_their_own_lines():
    g = Geometry(slots=5, capacity=300)
    spans = []
    for slot in range(g.slots):
        spans += [(g.bell(slot), 1), (g.done(slot), 1), (g.src(slot), g.capacity), (g.dst(slot), g.capacity)]
        assert g.bell(slot) % LINE_WORDS == 0 and g.done(slot) % LINE_WORDS == 0
        assert g.done(slot) - g.bell(slot) == LINE_WORDS
    spans.sort()
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b, (a, n, b)
    last, n = spans[-1]
    assert (last + n) * 4 <= g.num_bytes and g.num_bytes % 4096 == 0


def test_geometry_refuses_sizes_out_of_range():
    for slots, capacity in ((0, 16), (2000, 16), (4, 0)):
        with pytest.raises(ValueError, match="out of range"):
            Geometry(slots, capacity)


def test_a_second_mapping_of_a_page_sees_the_first_one_s_writes():
    g = Geometry(slots=2, capacity=8)
    page = Page.create(g)
    try:
        peer = Page.open(page.name, g)
        try:
            peer.write_ids(g.src(1), [7, 3, 5])
            assert page.read_ids(g.src(1), 3).tolist() == [7, 3, 5]
            page.words[g.bell(1)] = bell_value(4, 32)
            assert int(peer.words[g.bell(1)]) == 4 * BELL_STEP + 32
        finally:
            peer.close()
        assert page.words is not None  # the receiver's page outlives a sender's mapping
    finally:
        page.close()
    with pytest.raises(FileNotFoundError):  # the owner unlinked it
        Page.open(page.name, g)


def test_only_pages_this_project_names_are_opened():
    with pytest.raises(ValueError, match="not a page name"):
        Page.open("psm_other", Geometry(1, 1))


def test_slots_are_handed_out_once_quarantined_ones_rest_and_retired_ones_never_return():
    now = [0.0]
    table = SlotTable(3, clock=lambda: now[0])
    a, b, c = table.take(), table.take(), table.take()
    assert a is not None and b is not None and c is not None and {a[0], b[0], c[0]} == {0, 1, 2}
    assert table.take() is None  # none free: the lease goes unarmed
    table.put(a[0])
    again = table.take()
    assert again == (a[0], a[1] + 1)  # the same slot, the next generation
    table.quarantine(b[0])  # its lease ended unclaimed: its sender may still write into it
    table.retire(c[0])  # its chain did not end
    assert table.take() is None
    now[0] = QUARANTINE_S - 1.0
    assert table.take() is None
    now[0] = QUARANTINE_S
    assert table.take() == (b[0], b[1] + 1)
    table.put(again[0])
    assert table.take() == (again[0], again[1] + 1)
    assert table.take() is None  # the retired slot never comes back
    assert (table.quarantined, table.retired) == (1, 1)


def test_a_slot_retires_before_its_bells_overflow_32_bits():
    table = SlotTable(1)
    table._generation[0] = MAX_GENERATION - 1
    slot, generation = table.take()
    assert generation == MAX_GENERATION and bell_value(generation, ALL_LAYERS) < 2**32
    table.put(slot)
    assert table.take() is None


def test_transfer_config_bounds_the_doorbell_settings():
    assert TransferConfig(doorbell_slots=0).doorbell_slots == 0
    with pytest.raises(ConfigError, match="doorbell_slots"):
        TransferConfig(doorbell_slots=-1)
    with pytest.raises(ConfigError, match="doorbell_capacity"):
        TransferConfig(doorbell_capacity=0)
