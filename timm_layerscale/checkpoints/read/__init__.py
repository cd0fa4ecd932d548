"""Checkpoints in: what a file is from its first bytes (`sniff`), one lazy reader for every source
(`reader`) and DCP folders (`dcp/`, sealed: nothing outside it unpickles). Never imports `write` or `formats`.
"""
