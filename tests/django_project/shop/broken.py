"""A module that fails on import: a job naming a task in it must not hurt the worker."""

raise ZeroDivisionError("this module cannot be imported")
