"""Helpers the test directories share, one copy each.

Importable as ``support`` from every test directory and from the processes the
tests spawn: pyproject's ``pythonpath = ["tests"]`` puts this folder's parent
on ``sys.path``, and spawned ranks inherit ``sys.path``.
"""
