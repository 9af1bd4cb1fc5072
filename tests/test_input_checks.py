"""`kernels/base/input_checks.py`: one line naming the argument and what is allowed, the same from
every kernel that takes it; a traced value is checked for its shape and dtype only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mkresearch.kernels.base import input_checks as checks


def test_positions_name_the_cache_and_the_position_too_late():
    checks.check_positions(jnp.array([0, 7], jnp.int32), 2, 8)
    with pytest.raises(ValueError, match=r"^positions=\[3, 8\] is invalid: each in \[0, 8\) — "
                                         r"the cache holds 8 tokens, too short for position 8$"):
        checks.check_positions(jnp.array([3, 8], jnp.int32), 2, 8)
    with pytest.raises(ValueError, match=r"^positions=\[-1, 2\] is invalid: each in \[0, 8\)$"):
        checks.check_positions(jnp.array([-1, 2], jnp.int32), 2, 8)
    with pytest.raises(ValueError, match=r"^positions has shape \(3,\): expected \[B=2\]$"):
        checks.check_positions(jnp.zeros(3, jnp.int32), 2, 8)
    with pytest.raises(ValueError, match=r"^positions.dtype=float32 is invalid: int32$"):
        checks.check_positions(jnp.zeros(2, jnp.float32), 2, 8)


def test_a_traced_value_is_checked_where_it_is_concrete():
    @jax.jit
    def step(positions):
        checks.check_positions(positions, 2, 8)  # shape and dtype only: its values are traced
        checks.check_each_in("tokens", positions, 4)
        return positions + 1

    np.testing.assert_array_equal(step(jnp.array([9, 99], jnp.int32)), [10, 100])


def test_x_weights_and_keys():
    assert checks.check_x(jnp.zeros((3, 16), jnp.bfloat16), 16) == 3
    with pytest.raises(ValueError, match=r"^x has shape \(3, 8\): expected \[B, d=16\]$"):
        checks.check_x(jnp.zeros((3, 8), jnp.bfloat16), 16)
    with pytest.raises(ValueError, match=r"^x.dtype=float32 is invalid: bfloat16"):
        checks.check_x(jnp.zeros((3, 16), jnp.float32), 16)
    shapes = {"w": (2, 4), "g": (4,)}
    weights = {"w": jnp.zeros((2, 4), jnp.bfloat16), "g": jnp.zeros(4, jnp.float32)}
    checks.check_arrays(weights, "p", shapes, {"g": jnp.float32})
    with pytest.raises(ValueError, match=r"^p\['g'\].dtype=float32 is invalid: bfloat16$"):
        checks.check_arrays(weights, "p", shapes)
    with pytest.raises(ValueError, match=r"^p\['w'\] has shape None: expected \(2, 4\) \(why\)$"):
        checks.check_arrays({}, "p", shapes, note=" (why)")
    with pytest.raises(ValueError, match=r"^cache has keys \['k'\]: expected \['k', 'v'\]$"):
        checks.check_keys({"k": 0}, "cache", ("k", "v"))
