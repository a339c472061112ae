"""Realtime gateway for AI-agent chat apps."""

__version__ = "0.1.0"
