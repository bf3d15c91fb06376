"""Package discovery for a repository whose root is the `moetrace` package.

Every folder below the root with an __init__.py is a subpackage, so a new one cannot be
forgotten; tests/ and bench/ are scaffolding and never become moetrace.tests/bench.
This file sits in the package folder too, so it is kept out of the wheel by name.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

SCAFFOLDING = ["tests", "tests.*", "bench", "bench.*", "build", "build.*", "docs", "docs.*"]


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "moetrace" and m[1] == "setup")]


setup(
    package_dir={"moetrace": "."},
    packages=["moetrace"] + [f"moetrace.{p}" for p in find_packages(".", exclude=SCAFFOLDING)],
    cmdclass={"build_py": BuildPy},
)
