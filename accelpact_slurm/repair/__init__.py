"""L1 Preserve: the in-process repair engine, rebinders and real fault injection."""
