"""tokenmill.bench.table: column specs laid out exactly, None as n/a, the lines under a comparison."""
from __future__ import annotations

from tokenmill.bench.table import Column, comparison_lines, format_rows

COLUMNS = (Column("name", 6, lambda r: r[0], align="<"), Column("n", 4, lambda r: r[1]),
           Column("ms", 7, lambda r: r[2], ".1f"), Column("note", 0, lambda r: r[3], align="<", gap=2))


def test_rows_are_padded_to_each_columns_width_and_alignment():
    assert format_rows(COLUMNS, [("ab", 3, 1.25, "x"), ("abcdefgh", 12345, 10.0, "")]) == [
        "name     n     ms  note",
        "ab       3    1.2  x",
        "abcdefgh12345   10.0  ",  # a longer text is not cut; an empty last cell keeps its gap
    ]


def test_none_is_shown_as_n_a_in_the_cells_width():
    assert format_rows(COLUMNS[1:3], [(None, None, None, None)])[1] == " n/a    n/a"


def test_no_rows_gives_the_header_alone():
    assert format_rows(COLUMNS, []) == ["name     n     ms  note"]


def test_comparison_lines_are_ratios_then_skipped_peers_then_notes():
    assert comparison_lines({"out tokenmill/x": 2.0, "tot tokenmill/x": 1.234}, {"y": "absent"}, ["n1"]) == [
        "out tokenmill/x: 2.00x", "tot tokenmill/x: 1.23x", "skipped y: absent", "note: n1"]
    assert comparison_lines({}, {}, []) == []
