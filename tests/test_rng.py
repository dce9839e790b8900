"""asrprec.rng: the generator states a resume restores, and blocks that leave them untouched."""

import random

import numpy as np
import torch

from asrprec.rng import get_rng_state, preserved_rng, seed_from, seeded_rng, set_rng_state


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_state_round_trip_and_preserved_block():
    torch.manual_seed(1)
    state = get_rng_state()
    first = _draws()
    set_rng_state(state)
    assert _draws() == first
    set_rng_state(state)
    with preserved_rng():
        _draws()
        torch.randn(100)
    assert _draws() == first  # the block drew, the stream outside did not move


def test_seeded_block_draws_as_after_seeding_and_then_restores():
    torch.manual_seed(2)
    state = get_rng_state()
    after = _draws()
    set_rng_state(state)
    with seeded_rng(123):
        inside = _draws()
    assert _draws() == after
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    assert _draws() == inside  # the textbook seeding of all three generators


def test_seed_from_distinguishes_its_parts():
    assert seed_from(0, 1, "a") == seed_from(0, 1, "a") and 0 <= seed_from(0, 1, "a") < 2**63
    assert len({seed_from(0, e, "a") for e in range(50)}) == 50
    assert seed_from(0, 1, "a", "b") != seed_from(0, 1, "ab")
