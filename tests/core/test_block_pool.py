import pytest

from tailguard.core.block_pool import NULL_BLOCK, BlockPool


def test_allocate_answers_none_when_it_does_not_fit_and_takes_nothing() -> None:
    pool = BlockPool(num_blocks=5, block_size=16)
    assert pool.num_usable == 4
    got = pool.allocate(3)
    assert got is not None and len(got) == 3 and NULL_BLOCK not in got
    assert pool.allocate(2) is None
    assert pool.num_free == 1  # the failed request took nothing
    pool.free(got)
    assert pool.num_free == 4 and pool.num_used == 0


def test_blocks_for_rounds_up() -> None:
    pool = BlockPool(num_blocks=3, block_size=16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_needs_room_beyond_the_null_block() -> None:
    with pytest.raises(ValueError, match="block 0 is reserved"):
        BlockPool(num_blocks=1, block_size=16)
