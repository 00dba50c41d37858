"""Native and Triton kernels (optional accelerators; each has a torch reference elsewhere)."""
