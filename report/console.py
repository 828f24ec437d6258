"""The Console everything diagnose prints with (traindx.common.console: kernel-cache prints with it
too): a reader that went away silences it, and nothing from the job reaches the terminal as a
control sequence or with a secret in it."""

from traindx.common.console import Console

__all__ = ["Console"]
