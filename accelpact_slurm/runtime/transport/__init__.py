"""The job's own store (wire, server, host, client) and the control plane built on it."""
