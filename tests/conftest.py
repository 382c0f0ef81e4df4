"""What pytest gives every test under tests/ without an import: the fixtures of tests/common.py,
`offline` among them (autouse: no test touches the network). test_nanobatch.py, at the top, imports
them by name. And two hooks: the runs in a process of their own that the selected tests read (the
command line's, the server's Ctrl-C: tests/common.py's IN_BACKGROUND) start before the first test,
beside the others, and are waited for at the end."""
from tests.common import (at_8, gpt, gpt2_vocab, gpt_on, knee, offline, quick_demo, ran, smallest,  # noqa: F401
                          start_in_background, stop_background, workload)  # fixtures, found by name


def pytest_runtestloop(session):
    """Before the first test: the background runs of the selected tests start, beside the tests that run in
    this process (tests/common.py says why)."""
    if not session.config.option.collectonly:
        start_in_background(getattr(item, "originalname", None) for item in session.items)


def pytest_sessionfinish(session):
    stop_background()
