"""A Django app for tests/test_django_orm.py: orders, once per cart mandate."""
