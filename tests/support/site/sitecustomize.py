"""Python runs this at the start of every process the tests start (conftest.py puts this directory on PYTHONPATH):
the loopback guard of tests/support/loopback.py, loaded by its path so the process needs no `tests` package."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_tests_loopback", Path(__file__).resolve().parent.parent / "loopback.py")
_loopback = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_loopback)
_loopback.refuse_outside_connections()
