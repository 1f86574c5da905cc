"""The bad-input matrix (tests/bad_inputs): every case on every backend, one worker process
per backend, each case expecting one outcome (a named NumstabError naming the argument, or a
documented valid result). ``python -m tests.bad_inputs`` prints the table on its own."""

from __future__ import annotations

import pytest

from tests.bad_inputs.cases import all_cases
from tests.bad_inputs.runner import BACKENDS, run_all, summary_table

CASE_IDS = [c.id for c in all_cases()]


@pytest.fixture(scope="module")
def matrix():
    from conformance_tests.conftest import requested_backends

    backends = [b for b in BACKENDS if b in requested_backends()]
    return run_all(backends)


def test_catalogue_is_broad():
    assert len(CASE_IDS) >= 150


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input(matrix, case_id, backend):
    if backend not in matrix:
        pytest.skip(f"{backend} not requested (NUMSTAB_TEST_BACKENDS)")
    got = matrix[backend][case_id]
    assert got["ok"], f"{got['why']}: {got.get('error', '')} {got.get('message', '')}"


def test_same_outcome_class_on_every_backend(matrix, capsys):
    for case_id in CASE_IDS:
        outcomes = {
            b: matrix[b][case_id].get("error") or matrix[b][case_id]["kind"] for b in matrix
        }
        assert len(set(outcomes.values())) == 1, f"{case_id}: {outcomes}"
    with capsys.disabled():
        print("\n" + summary_table(matrix).splitlines()[-1])
