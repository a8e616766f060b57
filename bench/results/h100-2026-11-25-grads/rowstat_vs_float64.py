"""Debug: the _grads kernel's row sums (rowstat) and dtensor partials against float64, bias_h non-causal."""
import sys
sys.path.insert(0, ".")
import torch
import fagen
from fagen.runtime import kernel as K
from fagen.tools import testing

captured = {}
real = K._zeros
def spy(like, shape):
    x = real(like, shape)
    captured.setdefault("z", []).append(x)
    return x
K._zeros = spy

def run(dim, M, N, causal, tier="wgmma", dtype="bf16"):
    kern = fagen.compile(dim=dim, dtype=dtype, causal=causal, tier=tier,
                         score_mod=lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01)
    B, H = 2, 2
    q, k, v = testing.random_qkv(B, H, M, N, dim, dtype)
    bias = torch.rand(H, device="cuda") * 0.9 + 0.1
    o, lse = kern(q, k, v, return_lse=True, bias=bias)
    do = torch.randn_like(q)
    captured.clear()
    g = kern.backward(q, k, v, o, lse, do, bias=bias)
    torch.cuda.synchronize()
    rowstat = captured["z"][-1]
    entry = [e for key, e in kern._calls.items() if key[0] == "backward"][-1]
    dt = entry.dtensor
    sc = kern.default_scale
    qd, kd, vd, od, dod = (x.double() for x in (q, k, v, o, do))
    qi = torch.arange(M, device="cuda")[:, None].double(); ki = torch.arange(N, device="cuda")[None, :].double()
    s = sc * qd @ kd.transpose(-1, -2) + bias.double()[None, :, None, None] * (ki - qi) * 0.01
    if causal:
        s = s.masked_fill(ki > qi, float("-inf"))
    P = torch.exp(s - lse.double()[..., None])
    dP = dod @ vd.transpose(-1, -2)
    D = (dod * od).sum(-1)
    dS = P * (dP - D[..., None])
    gmat = 0.01 * (ki - qi)
    E = dS.sum(-1); R = (P * gmat).sum(-1)
    A = (dS * gmat).sum((-1, -2))  # per (b, h)
    print(f"d{dim} M={M} N={N} causal={causal} {kern.backward_plan.main_grads.spec.name}")
    print("  E err", float((rowstat[0].double() - E).abs().max()), "max|E|", float(E.abs().max()))
    print("  R err", float((rowstat[1].double() - R).abs().max()), "max|R|", float(R.abs().max()))
    print("  A (dtensor sum over tiles) err", float((dt[0].double().sum(-1) - A).abs().max()), "max|A|", float(A.abs().max()))
    print("  dtensor", dt[0].shape, dt[0].double().abs().max().item())
    bad = (rowstat[1].double() - R).abs() > 1e-2
    if bad.any():
        idx = bad.nonzero()[:8].tolist(); print("  bad R rows", idx)
    print("  dbias", g.tensors["bias"].tolist())

for args in ((128, 77, 130, False), (128, 77, 130, True), (64, 77, 130, False), (128, 300, 257, False)):
    try:
        run(*args)
    except Exception as e:
        print("ERR", args, repr(e)[:300])
