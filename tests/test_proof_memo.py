"""The proof memo: the state algebra proven once for given expressions is read back, never assumed."""

import dataclasses

import pytest
import sympy as sp

from fagen.ir import exprs
from fagen.math import memo, online_softmax
from fagen.math.online_softmax import ProofError


def _rule(**changes):
    return dataclasses.replace(online_softmax.make_rule(exprs.SCORE, sp.true), **changes)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Count the runs of the state proofs, with an empty memo in tmp_path and no in-process lru hit."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    runs = []
    real = online_softmax.prove_algebra.__wrapped__

    def algebra(rule):
        runs.append(rule)
        return real(rule)

    monkeypatch.setattr(online_softmax, "prove_algebra", algebra)
    return runs


def test_the_same_expressions_are_proven_once(counted, tmp_path):
    first = online_softmax.prove(_rule(), (), sp.Integer(1))
    second = online_softmax.prove(_rule(), (), sp.Integer(1))
    assert len(counted) == 1
    assert [(i.name, i.statement) for i in first] == [(i.name, i.statement) for i in second]
    assert len(list((tmp_path / "proofs").iterdir())) == 1


def test_a_different_score_reuses_the_state_proof_but_proves_its_own_scores(counted):
    online_softmax.prove(_rule(), (), sp.Integer(1))
    softcap = online_softmax.make_rule(30 * sp.tanh(exprs.SCORE / 30), sp.true)
    # the state proof is read back, but the score is checked against the graph: with no score_mod in the
    # chain, the softcap rule is not the graph's and is refused
    with pytest.raises(ProofError, match=r"\(c\) scores"):
        online_softmax.prove(softcap, (), sp.Integer(1))
    assert len(counted) == 1  # the state update is the same expressions


def test_a_broken_rule_is_refused_every_time_and_never_kept(counted, tmp_path):
    bad = _rule(alpha=2 ** (online_softmax.m_use - online_softmax.m_i))
    for _ in range(2):
        with pytest.raises(ProofError, match=r"\(a\) row sum"):
            online_softmax.prove(bad, (), sp.Integer(1))
    assert len(counted) == 2
    assert not (tmp_path / "proofs").exists() or not list((tmp_path / "proofs").iterdir())


def test_fresh_proofs_ignore_the_memo(counted):
    online_softmax.prove(_rule(), (), sp.Integer(1))
    with online_softmax.fresh_proofs():
        online_softmax.prove(_rule(), (), sp.Integer(1))
    assert len(counted) == 2


def test_a_corrupt_memo_entry_is_proven_again(counted, tmp_path):
    online_softmax.prove(_rule(), (), sp.Integer(1))
    (entry,) = (tmp_path / "proofs").iterdir()
    entry.write_text("{not json")
    online_softmax.prove(_rule(), (), sp.Integer(1))
    assert len(counted) == 2
    assert memo.proof_memo(("x",), lambda: [("n", "s")]) == (("n", "s"),)


def test_a_compile_proves_each_value_once(monkeypatch, tmp_path):
    """The passes prove, the backend prints: a compile proves the rewrite and the key ranges once (a decode op its
    merge too), and its backward the backward rule and the query ranges once, each with the same arguments never
    twice."""
    from fagen import pipeline
    from fagen.math import bounds
    from fagen.passes import backward, fuse

    calls = []

    def counted(owner, name):
        real = getattr(owner, name)

        def run(*args):
            calls.append((name, str(args)))
            return real(*args)

        monkeypatch.setattr(owner, name, run)

    counted(fuse, "prove")
    counted(bounds, "prove")
    counted(bounds, "prove_query_range")
    counted(online_softmax, "prove_merge")
    counted(backward, "prove_backward")
    kernel = pipeline.compile(64, causal=True, alibi=True, arch="sm_90a", tier="simt", cache_dir=tmp_path)
    assert sorted(name for name, _ in calls) == ["prove", "prove"]  # the rewrite's identities, its key ranges
    built = kernel.backward_plan  # built on first use: the backward's rule and transposed ranges
    assert sorted(name for name, _ in calls[2:]) == ["prove", "prove_backward", "prove_query_range"]
    assert "(transposed)" in " ".join(built.proofs)  # (bounds.prove of the transposed mask, inside)
    pipeline.compile(64, causal=True, decode=True, arch="sm_90a", tier="simt", cache_dir=tmp_path)
    assert "prove_merge" in [name for name, _ in calls]
    assert len(set(calls)) == len(calls), [c[0] for c in calls]
