"""The second half of the mutation check (``tests/test_mutation.py``): a file of its own so the
two CI workers (``--dist loadfile``) run the halves side by side at the end of the suite."""

import pytest

from tests.test_mutation import every_mutant_is_killed, needs_full_check


@pytest.mark.slow
@needs_full_check
def test_every_mutant_is_killed(tmp_path_factory):
    every_mutant_is_killed(1, tmp_path_factory)
