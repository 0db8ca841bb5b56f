#!/usr/bin/env python3
"""Runs the package's tests (unittest) and ends with 'N passed, M failed, K skipped', the line
scripts/summarize-tests counts. Without PyTorch or a GPU the GPU tests are counted as skipped."""
import pathlib
import sys
import unittest

here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent))
suite = unittest.defaultTestLoader.discover(str(here))
result = unittest.TextTestRunner(verbosity=2).run(suite)
failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
skipped = len(result.skipped)
print(f"{result.testsRun - failed - skipped} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
