"""Hand edits of the ALiBi sources: the slope coefficient computed once, not per tile. edit(name, src) -> src."""
import re

COEF = "(kLog2e/scale_log2)*fagen_read(tensor_slopes, fagen_at(h, tensor_slopes_size_0, tensor_slopes_stride_0))"
RAW_CALL = "rule::raw({x}, scale_log2, b, h, q_idx, k_idx, seqlen_q, seqlen_k, k_minus_q, q_f, tensor_slopes, tensor_slopes_stride_0, tensor_slopes_size_0)"


def edit(name, src):
    if "alibi" not in name or "softcap" in name:
        return src
    if name.startswith("flash_fwd") and "wgmma" in name:
        anchor = "            auto scores_and_mask = [&](int n0) {"
        assert src.count(anchor) == 1, name
        src = src.replace(anchor, f"            const float c_alibi = {COEF};\n" + anchor)
        call = RAW_CALL.format(x="S[4 * i + e]")
        assert src.count(call) == 1, name
        src = src.replace(call, "fmaf(c_alibi, k_minus_q, S[4 * i + e])")
        return src
    if name.startswith("flash_bwd") and "wgmma" in name and "grads" not in name:
        anchor = "        for (int step = 0, h = h_kv * heads_per_kv, t = 0; step < steps; ++step) {\n            const int m0 = m_first"
        assert src.count(anchor) == 1, name
        src = src.replace(anchor, f"        const float c_alibi = [&]() {{ const int h = h_kv * heads_per_kv; return {COEF}; }}();   // no GQA (experiment)\n" + anchor)
        call = RAW_CALL.format(x="x")
        assert src.count(call) == 2, (name, src.count(call))
        src = src.replace(call, "fmaf(c_alibi, k_minus_q, x)")
        return src
    return src


def install(codegen):
    orig = codegen.render

    def render(spec, *a, **k):
        return edit(spec.name, orig(spec, *a, **k))

    codegen.render = render
