"""Triton kernels and their launchers; the ops in torch_moe._ops decide when to call them."""
