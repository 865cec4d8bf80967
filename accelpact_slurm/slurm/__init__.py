"""slurm layer."""
