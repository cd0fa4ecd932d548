"""Checkpoints out: safetensors (header first, tensor by tensor, shards), `.pth` and text files staged and
renamed into place (`writers`), and DCP folders (`dcp`).
"""
