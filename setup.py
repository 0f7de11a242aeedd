"""Which packages an install holds (everything else is in pyproject.toml).

The checkout's top-level ``wrappers/`` and ``examples/`` folders are installed as
``belayer.wrappers`` and ``belayer.examples``: generic top-level names in site-packages
would collide with other projects'. ``belayer/__init__.py`` maps the same names onto the
folders when running from a checkout.
"""

from setuptools import find_packages, setup

FOLDERS = {"belayer.wrappers": "wrappers", "belayer.examples": "examples"}

packages = find_packages(include=["belayer", "belayer.*", "belayer_core", "belayer_core.*", "belayer_env", "belayer_env.*",
                                  "belayer_engine", "belayer_engine.*"])
for name, folder in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=FOLDERS)
