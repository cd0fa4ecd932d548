"""What the CLI uses to make LayerScale visible: generated data, a short trainer, gamma statistics, plots.

Nothing here is needed to build or load a model; plotting needs the optional `tools` extra (matplotlib).
"""
