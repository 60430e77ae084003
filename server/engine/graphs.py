"""Capturing one forward per size into CUDA graphs that share a memory pool."""

import torch


@torch.inference_mode()
def capture_graphs(forward, sizes, device: torch.device, prepare=None) -> dict:
    """``forward(size)`` captured for each size, largest first so the smaller graphs fit in the
    pool the largest one made. Returns ``{size: (graph, output)}``; replay writes ``output`` (what
    ``forward`` returned: a tensor or a tuple of them).
    ``prepare(size)``, if given, sets the static inputs before each size's eager warm-up runs."""
    graphs, pool = {}, None
    for size in sorted(sizes, reverse=True):
        if prepare is not None:
            prepare(size)
        for _ in range(2):
            forward(size)                          # warm-up: lazy initialisation, library heuristics
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward(size)
        pool = graph.pool()
        graphs[size] = (graph, output)
    torch.cuda.synchronize(device)
    return graphs
