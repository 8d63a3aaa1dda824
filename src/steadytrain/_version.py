"""The package version (one place: the root package, data provenance and run records read it)."""

__version__ = "0.1.0"
