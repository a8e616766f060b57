"""`fagen ir --backward`, end to end in a subprocess: the derived program, its proofs, the printed rule."""

from tests.test_cli import fagen


def test_ir_backward_shows_the_program_and_the_proofs():
    r = fagen("ir", "--dim", "64", "--causal", "--alibi", "--backward")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "== 5. backward: dQ, dK, dV" in out
    assert "delta: f32[B, H, M] = row_dot(do, o)" in out
    assert "dslopes: f32[H] = online_softmax_grad(q, k, v, do, lse, delta, scale=1/sqrt(D), " in out
    assert "output(dq, dk, dv, dslopes)" in out
    for ident in (
        "(g) softmax Jacobian",
        "(h) P from lse",
        "(i) chain rule",
        "(j) tensor gradients",
        "(k) fully masked row",
    ):
        assert f"  [proved] {ident}: " in out
    assert "[proved] (c) scores" in out  # the forward's steps are still shown
    assert "float ds(float p, float dp, float d_row)\n      = p*(-d_row + dp)" in out
    assert "float lse_log2(float lse)\n      = ((lse == (-FAGEN_INFINITY)) ? (FAGEN_INFINITY) : (kLog2e*lse))" in out
    assert "float d_slopes_h(float ds, " in out


def test_ir_without_backward_is_unchanged():
    r = fagen("ir", "--dim", "64")
    assert r.returncode == 0, r.stderr
    assert "online_softmax_grad" not in r.stdout and "backward" not in r.stdout


def test_ir_backward_refuses_a_score_it_cannot_differentiate(tmp_path):
    path = tmp_path / "stepped.ir"
    path.write_text(
        "program stepped\nq: T[B, H, M, D] = input()\nk: T[B, H, N, D] = input()\nv: T[B, H, N, D] = input()\n"
        "s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)\nc: f32[B, H, M, N] = score_mod(s, fn=floor(s))\n"
        "p: f32[B, H, M, N] = softmax(c, axis=N)\no: T[B, H, M, D] = matmul(p, v)\noutput(o)\n"
    )
    assert fagen("ir", "--dim", "64", "--ir", str(path)).returncode == 0  # the forward is fine
    r = fagen("ir", "--dim", "64", "--ir", str(path), "--backward")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("fagen: error: score function floor(s): floor(s) is piecewise constant in the score")
