"""The package list, found rather than listed (pyproject.toml holds everything else).

The checkout root is the package ``radixserve`` (``package-dir = {"radixserve" = "."}``), so every
folder below it with an ``__init__.py`` is a subpackage ``radixserve.<folder>``: a new one ships
without an edit here. setuptools' ``[tool.setuptools.packages.find]`` cannot add that prefix,
hence this file. What is not part of the package is excluded: tests, benchmarks, examples (an
example plugin is its own distribution), docs, scripts, build outputs.
tests/packaging/test_wheel.py builds the wheel and runs it from a fresh virtual environment.
"""

from setuptools import find_packages, setup

NOT_SHIPPED = ["tests", "bench", "examples", "docs", "tools", "build", "dist"]

setup(
    packages=["radixserve"]
    + [
        f"radixserve.{name}"
        for name in find_packages(
            where=".", exclude=[p for n in NOT_SHIPPED for p in (n, f"{n}.*")]
        )
    ]
)
