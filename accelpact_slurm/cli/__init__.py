"""Command-line entry points (each ``main(argv=None) -> int``)."""
