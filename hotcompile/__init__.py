"""hotcompile: HOT (Hadamard-based Optimized Training) as a torch.compile backend."""
