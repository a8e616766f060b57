"""The runtime: arrays from CuPy or PyTorch, the compiled op and its plan of launches."""
