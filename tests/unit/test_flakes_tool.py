"""tools/flakes: the summary of N runs' JUnit files (every test that failed
in at least one run, its failure lines, runs that left no result)."""

import importlib.machinery
import importlib.util
import os

import pytest

from helpers import ROOT


def _flakes():
    path = os.path.join(ROOT, "tools", "flakes")
    loader = importlib.machinery.SourceFileLoader("flakes_tool", path)
    spec = importlib.util.spec_from_loader("flakes_tool", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _junit(folder, cases):
    """A JUnit file as pytest writes it: `cases` = [(name, failure text or
    None)]."""
    os.makedirs(folder)
    body = "".join(
        f'<testcase classname="tests.e2e.test_x" name="{name}">'
        + (
            f'<failure message="AssertionError: boom">{text}</failure>'
            if text
            else ""
        )
        + "</testcase>"
        for name, text in cases
    )
    with open(os.path.join(folder, "junit.xml"), "w") as file:
        file.write(f"<testsuites><testsuite>{body}</testsuite></testsuites>")


def test_a_test_that_failed_in_one_run_is_listed_with_its_lines(tmp_path):
    flakes = _flakes()
    lines = "def test():\n&gt;   assert 1 == 2\nE   assert 1 == 2"
    _junit(tmp_path / "run-1", [("test_a", None), ("test_b", None)])
    _junit(tmp_path / "run-2", [("test_a", lines), ("test_b", None)])
    os.makedirs(tmp_path / "run-3")  # killed at --timeout: no result file
    summary = flakes.summarise(str(tmp_path))
    assert summary["runs"] == 3
    assert summary["runs_without_results"] == [3]
    assert summary["test_runs"] == 4
    assert summary["failed_tests"] == {
        "tests.e2e.test_x::test_a": {
            "runs": 2,
            "failed_in": {"2": ["AssertionError: boom", "E   assert 1 == 2"]},
        }
    }


def test_hosts_tests_are_refused_side_by_side():
    flakes = _flakes()
    with pytest.raises(SystemExit) as refused:
        flakes.parse_arguments(["--jobs", "2", "tests/hosts"])
    assert refused.value.code == 2
    assert flakes.parse_arguments(["--jobs", "1", "tests/hosts"]).jobs == 1
    assert flakes.parse_arguments([]).pytest_args == [
        "tests/multiprocess",
        "tests/e2e",
    ]
