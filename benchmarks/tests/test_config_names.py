"""The names the decode benchmarks give tile configurations (paged_kernels_common.config_key,
parse_config): every configuration and split policy they time reads back as itself, and a name
that is not one is refused, naming it."""

from __future__ import annotations

import pytest

from benchmarks.kernels.paged_kernels_common import config_key, parse_config
from tandem.kernels.paged_decode_launch import (
    DEFAULT_SPLIT_POLICY,
    UNSPLIT_CANDIDATES,
    UNSPLIT_CANDIDATES_FP8,
    DecodeConfig,
)


@pytest.mark.parametrize("cfg", [*UNSPLIT_CANDIDATES, *UNSPLIT_CANDIDATES_FP8,
                                 DecodeConfig(32, 2, 4, True, max_registers=96)])
def test_a_config_reads_back_as_itself(cfg):
    assert parse_config(config_key(cfg)) == (cfg, DEFAULT_SPLIT_POLICY)


def test_a_split_policy_rides_along():
    policy = DEFAULT_SPLIT_POLICY._replace(min_split_tokens=512)
    key = config_key(DecodeConfig(128, 4, 3, True, max_registers=160), policy)
    assert key == "n128/w4/s3/f16/r160/m512"
    assert parse_config(key) == (DecodeConfig(128, 4, 3, True, max_registers=160), policy)


@pytest.mark.parametrize("name", ["n128-w4", "n128/w4", "w4/n128/s3", "n128/w4/s3/f32",
                                  "n128/w4/s3/x1", "n128/w4/s3/rq"])
def test_a_name_that_is_no_config_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=name):
        parse_config(name)
