"""Hand edit: the wgmma forward's k - q as one conversion a tile plus constants (FADD), not a conversion a value."""
OLD = "                        const float k_minus_q = (float)(k_idx - q_idx), q_f = (float)q_idx;"
NEW = "                        const float k_minus_q = kq0 + (float)(8 * i + (e & 1) - 8 * (e >> 1)), q_f = (float)q_idx;"
ANCHOR = "#pragma unroll\n                for (int i = 0; i < BLOCK_N / 8; ++i)\n#pragma unroll\n                    for (int e = 0; e < 4; ++e) {\n                        const int q_idx = q_idx0 + 8 * (e >> 1);"


def edit(name, src, dims):
    if not (name.startswith("flash_fwd") and "wgmma" in name and "alibi" in name and any(f"_d{d}_" in name for d in dims)):
        return src
    assert src.count(OLD) == 1 and src.count(ANCHOR) == 1, name
    src = src.replace(OLD, NEW)
    return src.replace(ANCHOR, "                const float kq0 = (float)(n0 + 2 * (lane % 4) - q_idx0);   // k - q of element (0, 0)\n" + ANCHOR)


def install(codegen, dims):
    orig = codegen.render

    def render(spec, *a, **k):
        return edit(spec.name, orig(spec, *a, **k), dims)

    codegen.render = render
