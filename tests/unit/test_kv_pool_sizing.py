"""Sizing the KV pool on a GPU: what the profile runs set aside, and the runs themselves (the
largest step with its rows sampled on the sampler's heaviest path) on the CPU with a tiny model."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.pool_sizing import kv_pool_blocks

MiB = 1 << 20


@pytest.mark.parametrize("fraction", [0.5, 0.9, 1.0])
def test_pool_takes_its_fraction_of_what_the_profile_leaves(fraction):
    free, reserved, block = 80_000 * MiB, 6_000 * MiB, 2 * MiB
    blocks = kv_pool_blocks(free, reserved, fraction, block)
    left = free - reserved
    # The pool takes the fraction, to within a block; the rest stays free as headroom.
    assert left * fraction - block < blocks * block <= left * fraction
    assert free - reserved - blocks * block >= left * (1 - fraction)


def test_no_room_is_zero_blocks_not_negative():
    assert kv_pool_blocks(1_000 * MiB, 2_000 * MiB, 0.9, MiB) == 0


def test_profile_runs_leave_the_block_table_as_they_found_it(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), max_model_len=256),
                       progress=False)
    runner = engine.runner
    rows_before = list(runner.block_tables.free_rows)
    # Two prompt chunks of the max model length, 64 rows sampled on the heaviest path.
    runner._profile_run(512, 256, rows=64)
    runner._profile_decode(64)
    assert sorted(runner.block_tables.free_rows) == sorted(rows_before)
    assert not runner.block_tables.state
