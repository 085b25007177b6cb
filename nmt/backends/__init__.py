"""What decoding computes with: a backend, chosen once when a model is prepared for decoding
(nmt.generation.inference.choose_backend) and called by the model and the search alike.
torch_backend.py is the interface and its PyTorch implementation, cpu_backend.py nmt's C kernels on a
CPU. Import from the modules: this file imports nothing, so that the model's import of the plain
backend never loads the fast path."""
