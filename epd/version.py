"""The package version (`epd --version`, `/version`): one place, importable without the rest of `epd`."""
__version__ = "0.1.0"  # keep equal to pyproject.toml's version
