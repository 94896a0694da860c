"""Host cost of giving gradients to many expert-weight leaves (diagnostic for bench/NOTES.md).

Per variant: host microseconds for Function.apply (forward) and for backward, with n leaf weights on the GPU.
"""

import time

import torch

G = None


class Returned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *ws):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return (g, *G.unbind(0))


class NoneGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *ws):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return (g, *([None] * len(G)))


class Direct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ws):
        ctx.ws = ws
        return x * 2

    @staticmethod
    def backward(ctx, g):
        for w, gw in zip(ctx.ws, G.unbind(0)):
            w.grad = gw
        return g, None


def run(n, variant):
    global G
    G = torch.zeros(n, 64, 64, device="cuda")
    ws = [torch.randn(64, 64, device="cuda", requires_grad=True) for _ in range(n)]
    x = torch.randn(64, device="cuda", requires_grad=True)
    fwd, bwd = [], []
    for i in range(30):
        t0 = time.perf_counter()
        y = Direct.apply(x, ws) if variant is Direct else variant.apply(x, *ws)
        t1 = time.perf_counter()
        y.sum().backward()
        t2 = time.perf_counter()
        for w in ws:
            w.grad = None
        if i >= 10:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return sorted(fwd)[10] * 1e6, sorted(bwd)[10] * 1e6


for n in (128, 384, 768):
    for variant in (Returned, NoneGrads, Direct):
        f, b = run(n, variant)
        print(f"n={n:4} {variant.__name__:10} forward {f:8.1f} us  backward {b:8.1f} us")
