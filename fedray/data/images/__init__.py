"""Images: finding them (``index``, ``folder``), decoding them for a network (``decode``) and the networks (``backbones``)."""

GRAYSCALE_POLICIES = ("convert", "skip")
"""What :func:`fedray.data.images.decode.load_image` does with a grayscale image; here, free of torch, for the command line's help."""
