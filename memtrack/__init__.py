"""memtrack."""

# The one place the version is written (pyproject.toml reads it from here): the
# launcher answers `memtrack --version` with it and the manifest records it, with no
# importlib.metadata (~0.1 s of imports).
__version__ = "0.1.0"
