"""The step planner's cut of ntk_dynamic rows into rows of one rotation each
(rope_plugins/attention/planner.py); the attention it plans is checked against the oracle in
test_attention.py."""

from __future__ import annotations

import torch

from rope_plugins.attention.planner import dynamic_sub_rows
from rope_plugins.rules.checkpoint import CheckpointRotary
from rope_plugins.rules.settings import DYNAMIC_STEP, ExtensionSettings
from rope_plugins.testing.reference import oracle_query_frequencies
from rope_plugins.worker.row_tables import RowTables, row_values

HEAD, BASE, TRAIN = 16, 10000.0, 100


def tables_of(settings: list[ExtensionSettings]) -> RowTables:
    tables = RowTables(len(settings), HEAD // 2)
    for row, one in enumerate(settings):
        tables.write(row, row_values(one, CheckpointRotary.plain(HEAD, BASE, 4096)))
    return tables


def test_a_step_without_dynamic_rows_is_left_alone():
    tables = tables_of([ExtensionSettings(method="ntk_old", train_length=TRAIN)])
    assert dynamic_sub_rows(tables, torch.tensor([0, 500]), torch.tensor([500])) is None


def test_dynamic_rows_are_cut_where_the_factor_steps_and_each_piece_has_its_queries_theta():
    dynamic = ExtensionSettings(method="ntk_dynamic", train_length=TRAIN)
    fixed = ExtensionSettings(method="rerope", window=10, train_length=TRAIN)
    # rows: a whole prompt of 400 (positions 0..399), a decode row, a fixed-θ chunk, a chunk
    # from position 227 to 232 (one step at 228), a chunk inside training
    query_lens, seq_lens = [400, 1, 50, 6, 30], [400, 700, 300, 233, 90]
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    tables = tables_of([dynamic, dynamic, fixed, dynamic, dynamic])
    pieces = dynamic_sub_rows(tables, starts, torch.tensor(seq_lens))
    step = DYNAMIC_STEP
    # the factor steps at positions TRAIN + j step: 100, 228, 356 (a piece ends before each)
    expected_ends = [100, 100 + step, 100 + 2 * step, 400, 700, 300, 100 + step, 233, 90]
    assert pieces.seq_lens.tolist() == expected_ends
    assert pieces.batch_row.tolist() == [0, 0, 0, 0, 1, 2, 3, 3, 4]
    assert pieces.starts.tolist() == [0, 100, 228, 356, 400, 401, 451, 452, 457, 487]
    # every query of a piece has the θ the oracle gives its own position
    for piece in range(len(expected_ends)):
        row = int(pieces.batch_row[piece])
        settings = [dynamic, dynamic, fixed, dynamic, dynamic][row]
        first = int(pieces.seq_lens[piece]) - int(pieces.starts[piece + 1] - pieces.starts[piece])
        positions = torch.arange(first, int(pieces.seq_lens[piece]))
        expected = oracle_query_frequencies(settings, HEAD, BASE, positions)
        torch.testing.assert_close(pieces.tables.theta[piece].expand_as(expected), expected, rtol=1e-12, atol=0)
    assert pieces.tables.window.tolist()[5] == 10  # the other settings follow their rows
