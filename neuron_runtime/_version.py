"""The package's version and directory: a leaf the layers read without importing the package root (which
imports every layer)."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"
PACKAGE_DIR = str(Path(__file__).resolve().parent)
