"""dapple's packaging is declared in pyproject.toml; this file lets older tools build it too."""
from setuptools import setup

setup()
