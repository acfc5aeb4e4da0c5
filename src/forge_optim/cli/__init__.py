"""Command line: ``forge-optim train`` (the main job) and ``forge-optim bench``."""
from .main import main

__all__ = ["main"]
