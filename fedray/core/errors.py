"""The one exception type users see."""


class FedrayError(Exception):
    """Bad input or configuration: the message is one line naming what is wrong."""


def shown(value: object) -> str:
    """``value`` as a one-line message shows it: its repr, or its type's name when the repr spans lines or runs long
    (an array, a table passed where a number goes)."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= 200 else type(value).__name__
