"""Builders and fakes shared by the tests. Fixtures stay in the conftest.py files."""
