"""rayslice's version, in a module of its own.

Both sides read it (a spec records the version that made it, the launcher compares it with its
own), and `rayslice/__init__.py` re-exports it as `rayslice.__version__`. Kept out of the package's
`__init__` so that core modules can import it without importing the package that imports them.
"""

__version__ = "0.1.0"
