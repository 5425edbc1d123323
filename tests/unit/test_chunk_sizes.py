"""tvmgraph/schedules/chunk_sizes.py: the divisor a long sum's chunks are cut at."""

import pytest

from tvmgraph.schedules.chunk_sizes import divisor_between


@pytest.mark.parametrize(
    "extent, least, most, multiple_of, expected",
    [
        (1000, 30, 60, 1, 40),  # the smallest divisor in the range, not the nearest to `least`
        (1000, 41, 60, 1, 50),
        (1000003, 2, 5000, 1, None),  # a prime has none
        (4096, 100, 1000, 16, 128),  # whole vectors: 112 and 104 do not divide, 128 does
        (3 * 4099, 2, 20, 16, None),  # divisors 3 exist, but none is a whole number of vectors
        (64, 0, 8, 1, 1),  # `least` 0 starts at 1: no chunk of zero elements
        (96, 50, 40, 1, None),  # an empty range
    ],
)
def test_the_smallest_divisor_in_range_and_whole_vectors(extent, least, most, multiple_of, expected):
    assert divisor_between(extent, least, most, multiple_of) == expected
