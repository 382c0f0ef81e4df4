"""What pytest gives every test under tests/ without an import: the fixtures of tests/common.py,
`offline` among them (autouse: no test touches the network). test_nanobatch.py, at the top, imports
them by name."""
from tests.common import gpt, gpt2_vocab, gpt_on, offline, quick_demo  # noqa: F401 (fixtures, found by name)
