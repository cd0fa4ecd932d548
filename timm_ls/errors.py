"""The command's one error type: bad input, printed as one `timm-ls: error:` line with exit status 2."""

from __future__ import annotations


class CliError(Exception):
    """Bad input: printed as one `timm-ls: error:` line."""
