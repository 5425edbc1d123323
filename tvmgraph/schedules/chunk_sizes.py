"""Chunk sizes for long float32 sums: the one divisor search the reduction schedules share.

A chain of float32 additions loses digits as it grows, so a long sum is cut into chunks, each
summed on its own, then the chunks' sums added (schedules/reduction.py: `_chunk_partials` for a
sum to one value, `_chunk_long_row` for a long row, `_column_chunks` for a long column;
one_value_sums.py `cut` for a length no chunk divides). A chunk is a whole number of iterations
of one loop, at a divisor of its extent: a partial last chunk needs a predicate, which TVM's
`compute_at` drops when the chunks' block moves.
"""

from __future__ import annotations


def divisor_between(extent: int, least: int, most: int, multiple_of: int = 1) -> int | None:
    """The smallest divisor of `extent` in [least, most] that is a multiple of `multiple_of`
    (whole vectors of the innermost loop), or None when there is none."""
    return next((d for d in range(max(least, 1), most + 1)
                 if extent % d == 0 and d % multiple_of == 0), None)
