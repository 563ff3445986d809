"""GPU (Triton) attention kernels; each module is imported on demand and registers its ``torch.library`` ops."""
