"""Errors a user can cause: each carries one sentence naming the setting."""


class SUPAConfigError(ValueError):
    """A setting the SUPA platform cannot serve; the message says which and
    what would work."""
