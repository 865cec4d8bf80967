"""Fault detection: heartbeats and verdicts (liveness), the data-plane detector (collectives), its wiring, peers."""
