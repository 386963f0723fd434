"""Probes of this step: which ops vary with the batch, alone against together, the kernels' bits and speed."""
