"""common/versions.py: version strings as tuples of ints."""

import jax
import pytest

from distrib_train.common.versions import jax_version, release


@pytest.mark.parametrize(
  "text,numbers",
  [
    ("0.10.2", (0, 10, 2)),
    ("0.11.0.dev20250601", (0, 11, 0)),
    ("0.12.1rc1", (0, 12, 1)),
    ("1.0+cuda", (1, 0)),
    ("7", (7,)),
  ],
)
def test_release_numbers_stop_at_the_first_part_that_is_not_a_number(text, numbers):
  assert release(text) == numbers


def test_a_version_without_a_number_is_refused_naming_it():
  with pytest.raises(ValueError, match="'dev' does not start with a release number"):
    release("dev")


def test_jax_version_is_the_installed_release_and_compares_by_prefix():
  assert jax_version() == release(jax.__version__)
  assert jax_version() >= (0, 10) and jax_version() < (1000,)
