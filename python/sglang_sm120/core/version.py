"""The overlay's version (pyproject.toml's), where every layer may read it: it is part of the routing-table key."""

__version__ = "0.1.0"
