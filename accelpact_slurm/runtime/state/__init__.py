"""The training state: extra state, buffers, digest, snapshot reload and its fit, replay check, saving, sampler."""
