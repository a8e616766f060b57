"""`fagen bench`'s training and deterministic figures on the GPU, small enough to take seconds: the checks that run
before anything is timed pass with fagen's real kernels (bench/model.py's first-step check of a Llama-style
training step against float32 sdpa; bench/backward.py's check of the deterministic backward: bitwise
reproducible, close to the default mode's)."""

import math

import pytest

pytestmark = pytest.mark.gpu


def test_the_training_step_of_every_implementation_passes_its_check():
    """One layer of the bench's model (32/8 heads, d128), 2048 tokens: sdpa, fagen and compiled FlexAttention."""
    pytest.importorskip("transformers")
    from fagen.tools.bench import model

    rows = model.run_training(layers=1, tokens=2048, rounds=1)
    assert [r["status"] for r in rows] == ["ok"] * 6, model.train_table(rows)
    assert all(r["ms"] > 0 and r["errors"][1] <= r["bounds"][1] for r in rows)


@pytest.mark.parametrize("variant", ["none", "packed"])
def test_the_deterministic_backward_is_reproducible_and_timed(variant):
    from fagen.tools.bench import backward, cases
    from fagen.tools.bench.forward import Session

    case = cases.cases(dims=(128,), seqlens=(2048,), causal=("top_left",), variants=(variant,))[0]
    rows = backward.backward_case(Session(), case, ("fagen", cases.DETERMINISTIC), rounds=1)
    by = {r.backend: r for r in rows}
    assert by["fagen"].status == by[cases.DETERMINISTIC].status == "ok", [r.status for r in rows]
    assert by[cases.DETERMINISTIC].err <= backward.DETERMINISTIC_RTOL and math.isfinite(by[cases.DETERMINISTIC].ms)
