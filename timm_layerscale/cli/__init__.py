"""`timm-ls`'s commands, one module each, each with `execute(args)`: what runs once the torch-free front
(`timm_ls`: the parsers, the checks, the entry point) has parsed and checked the arguments."""
