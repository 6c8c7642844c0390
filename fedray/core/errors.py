"""The one exception type users see."""


class FedrayError(Exception):
    """Bad input or configuration: the message is one line naming what is wrong."""
