"""The package list, found rather than written: setuptools finds every package under
``amp_rewrite/`` and under ``rules/`` (shipped as ``amp_rewrite.rules.defaults``), so a new
folder can never be left out of the wheel. Everything else lives in pyproject.toml.

The rule files sit at the top of the checkout, where users look for them; pyproject.toml alone
cannot both find ``amp_rewrite``'s packages and map that folder into the package, hence this file.
"""

from setuptools import find_packages, setup

RULES = "amp_rewrite.rules.defaults"

setup(
    packages=find_packages(include=["amp_rewrite", "amp_rewrite.*"])
    + [RULES] + [f"{RULES}.{name}" for name in find_packages("rules")],
    package_dir={RULES: "rules"},
)
