"""The ``Examples:`` in jpack's docstrings run and print what they show (doctest)."""

import doctest
import importlib

import pytest

MODULES = ["jpack._layout", "jpack._pack", "jpack._collectives", "jpack._transforms",
           "jpack._sharded", "jpack._labels", "jpack._precision"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0, f"{name} has no docstring examples"
  assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
