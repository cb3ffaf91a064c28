"""pyproject.toml as setuptools reads it: metadata that keeps building (no deprecated form)."""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_license_is_an_spdx_expression_setuptools_accepts_without_warning():
    """`license = { text = ... }` is deprecated by setuptools (its builds stop accepting it in 2027); an SPDX
    expression (PEP 639) goes into the metadata as License-Expression."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any deprecation of the configuration fails here
        distribution = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert distribution.metadata.license_expression == "MIT"
