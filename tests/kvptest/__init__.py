"""Helpers the tests share, in a package whose name no product module has: pytest puts
``tests/`` on the path (its conftest), so tests import ``kvptest.<module>``."""
