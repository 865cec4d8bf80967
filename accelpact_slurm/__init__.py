"""AccelPact-Slurm: fault recovery for PyTorch HSDP training on Slurm.

L1 Preserve repairs a failed inter-node replication communicator in process;
L2 Restart fails stop, requeues and reloads the newest verified checkpoint.
Importing this package does not import torch (login-node tools depend on it).
"""

__version__ = "0.1.0"
