"""The driver contract suite (see conftest.py for how to add a driver)."""
