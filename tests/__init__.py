# tests/ is a package, so that every test file, here and at the root, imports `from tests.common import ...`.
import pytest

pytest.register_assert_rewrite("tests.common")  # its helpers' asserts explain themselves as a test's do
