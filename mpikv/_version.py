"""The package's version, in a module of its own: modules of the package read it
from here, not from ``mpikv/__init__.py``, which would be an import circle."""

__version__ = "0.1.0"
