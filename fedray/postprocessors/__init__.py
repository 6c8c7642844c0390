"""Postprocessors shipped with fedray but written as plugins, against the public interface (``import fedray``) only."""
