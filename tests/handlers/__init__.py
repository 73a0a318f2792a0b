"""Small handler modules and helper programs for the worker tests."""
