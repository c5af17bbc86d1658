"""Shrinking a tile configuration into the shared-memory budget."""

from ember.kernels.tiles import shrink_to_fit


def _bytes(config):
    return config["N"] * config["S"] * 1000


def test_steps_apply_in_order_until_it_fits():
    steps = [("N", 64, True), ("S", 2, False)]
    assert shrink_to_fit({"N": 256, "S": 4}, _bytes, steps, budget=128_000) == {"N": 64, "S": 2}
    assert shrink_to_fit({"N": 256, "S": 4}, _bytes, steps, budget=600_000) == {"N": 128, "S": 4}


def test_a_config_that_cannot_shrink_is_returned_as_is():
    config = {"N": 64, "S": 2}
    assert shrink_to_fit(config, _bytes, [("N", 64, True), ("S", 2, False)], budget=1) == config
