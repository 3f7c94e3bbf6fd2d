"""The distrun version; the client and every worker server must agree on it."""

__version__ = "0.1.0"
