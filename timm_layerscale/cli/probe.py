"""`timm-ls probe DATA --model NAME ... --out DIR`: Meta's frozen-feature protocols on a folder of images.

The front parses the flags into a `ProbeRequest` (`timm_ls.probe_request`) and reads the folder; this module
loads each model as `timm-ls features` does (`features.load_model`) and prints; the run is
`timm_layerscale.probe.run`'s: features cached per block, the protocols, results.json and the chart.
"""

from __future__ import annotations

import torch

from timm_ls.probe_request import ProbeRequest

from ..probe import report
from ..probe.run import check_data, probe_model, write_outputs
from .common import table, warn
from .features import find_device, load_model


def execute(request: ProbeRequest) -> int:
    device = find_device(request.device)
    if request.threads:
        torch.set_num_threads(request.threads)
    folder = request.folder
    num_classes = check_data(folder, request)
    rows = []
    for name in request.models:
        torch.manual_seed(0)  # random-init weights are the same on every run: their cache is found again
        found = probe_model(load_model(name, request.source), folder, request, device, num_classes)
        print("\n".join(found.lines))
        for line in found.warnings:
            warn(line)
        rows += found.rows
    print(table(*report.table_of(folder.task, rows)))
    print("\n".join(write_outputs(folder, request, rows)))
    return 0
