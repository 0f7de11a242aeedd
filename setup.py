"""Which packages an install holds (everything else is in pyproject.toml)."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["belayer", "belayer.*", "belayer_core", "belayer_core.*",
                                      "belayer_env", "belayer_env.*", "belayer_engine", "belayer_engine.*"]))
