"""Tools around the compiler: the command line, the NumPy reference executor, GPU checks, bench and tune."""
