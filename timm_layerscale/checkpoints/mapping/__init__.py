"""Checkpoints mapped: plans over tensors known by shape before any is read (`plan`, `TensorInfo`), two-way
key tables (`keys`), LayerScale's key spellings (`gamma_keys`) and what loading does with gammas
(`layer_scale`), and fitting native keys to exactly a model's (`fit`). Reads no file and writes none.
"""
