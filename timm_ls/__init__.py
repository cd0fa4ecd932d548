"""`timm-ls`'s front: the command's parsers and entry point, and what the package shares without torch.

Nothing here imports torch or timm, so `timm-ls --help`, `--version` and bad arguments answer at once; a
command's own module (`timm_layerscale.cli.<command>`), which does, is loaded only when it runs.
"""
