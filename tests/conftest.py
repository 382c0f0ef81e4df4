"""What pytest gives every test under tests/ without an import: the fixtures of tests/common.py,
`offline` among them (autouse: no test touches the network). test_nanobatch.py, at the top, imports
them by name. And two hooks: the command-line runs of tests/test_cli.py start before the first test,
beside the others, and are waited for at the end."""
import sys

from tests.common import (at_8, gpt, gpt2_vocab, gpt_on, knee, offline, quick_demo, smallest,  # noqa: F401
                          workload)  # fixtures, found by name


def pytest_runtestloop(session):
    """Before the first test: the command-line runs that the selected tests of tests/test_cli.py wait for
    start, beside the tests that run in this process (that file says why)."""
    cli = sys.modules.get("tests.test_cli")  # imported if collected
    if cli is not None and not session.config.option.collectonly:
        cli.start_in_background(getattr(item, "originalname", None) for item in session.items)


def pytest_sessionfinish(session):
    cli = sys.modules.get("tests.test_cli")
    if cli is not None:
        cli.stop_background()
