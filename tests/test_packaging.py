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


def test_every_file_the_packages_read_besides_python_goes_into_a_wheel():
    """The dashboard's components read their JavaScript and CSS next to their modules: a wheel without them (setuptools
    takes only the package-data patterns) fails at import. `dashboard/static/` is written by the server itself."""
    import fnmatch

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    patterns = apply_configuration(Distribution(), ROOT / "pyproject.toml").package_data
    left_out = [
        str(path.relative_to(ROOT)) for package in ("engine", "dashboard") for path in (ROOT / package).rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "static" not in path.relative_to(ROOT).parts
        and not any(fnmatch.fnmatch(str(path.relative_to(ROOT / package)), pattern)
                    for pattern in patterns.get(package, []))
    ]
    assert left_out == []
