"""The mutant runner (tests/rocm/mutants.py) counts a mutant as caught only when its tests ran and failed."""

from __future__ import annotations

import pytest
from mutants import MUTANTS, ROOT, caught_by


@pytest.mark.parametrize("code, stdout, caught", [
    (1, "FAILED tests/rocm/x.py::test_a - AssertionError\n1 failed, 2 passed in 0.1s", True),
    (0, "3 passed in 0.1s", False),
    (2, "ERROR collecting tests/rocm/x.py\n1 error in 0.1s", False),  # interrupted: a collection error
    (3, "INTERNALERROR", False),
    (4, "ERROR: not found: tests/rocm/x.py::test_gone", False),  # a test id that names nothing
    (5, "no tests ran in 0.01s", False),  # e.g. every test skipped away in a venv without triton
    (1, "", False),  # exit 1 without a reported failure is not a catch either
])
def test_only_real_test_failures_count_as_a_catch(code, stdout, caught):
    """On the old runner (``returncode != 0``) exits 2 / 3 / 4 / 5 counted as catches: this test FAILS there
    (mori-total-recv-item and mori-raise-before-exchange were "caught" by exit 4 in a venv without triton)."""
    assert caught_by(code, stdout) is caught


def test_every_mutant_names_tests_that_exist_and_a_snippet_that_applies_once():
    for m in MUTANTS:
        text = (ROOT / "megamoe_backend" / m.path).read_text()
        assert text.count(m.old) == 1, m.name
        for test in m.tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), (m.name, test)
