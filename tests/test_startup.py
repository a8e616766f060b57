"""Start-up: `import fagen` loads nothing heavy, and a compile cached on disk comes back in a fresh process
without SymPy (structural checks on sys.modules, not timings)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fagen
from fagen import cache, request

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("sympy", "cupy", "networkx", "jinja2", "numpy")


def run_python(code: str, **env) -> str:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in env.items()}}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def loaded_after(code: str, **env) -> set[str]:
    out = run_python(code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))", **env)
    return {m.split(".")[0] for m in json.loads(out.splitlines()[-1])}


def test_import_fagen_loads_nothing_heavy():
    loaded = loaded_after("import fagen")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_cli_version_and_help_load_nothing_heavy():
    for flag in ("--version", "--help"):
        code = f"import fagen.tools.cli\ntry:\n    fagen.tools.cli.main([{flag!r}])\nexcept SystemExit:\n    pass"
        loaded = loaded_after(code)
        assert not loaded & set(HEAVY), (flag, sorted(loaded & set(HEAVY)))


def test_every_public_name_resolves():
    for name in fagen.__all__:
        assert getattr(fagen, name) is not None
    from fagen import Kernel, compile, tanh, where  # noqa: F401

    assert fagen.Kernel.__module__ == "fagen.runtime.kernel" and fagen.backend.__name__ == "fagen.backend"
    assert set(fagen.__all__) <= set(dir(fagen))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fagen.nope  # noqa: B018


COMPILE = (
    "import fagen, hashlib, json, sys\n"
    "k = fagen.compile(64, causal=True, dtype='f16', arch='sm_90a')\n"
    "print(json.dumps(dict(name=k.name, spec=k.spec.to_dict(), cached=k.binary.cached,\n"
    "    source=hashlib.sha256(k.source.encode()).hexdigest(), scale=k.default_scale,\n"
    "    cubin=hashlib.sha256(k.binary.cubin).hexdigest(), reason=k.tier_reason,\n"
    "    heavy=sorted(m for m in ('sympy', 'networkx', 'jinja2', 'cupy', 'numpy') if m in sys.modules))))"
)


def test_second_compile_in_a_fresh_process_hits_without_sympy(tmp_path):
    first = json.loads(run_python(COMPILE, FAGEN_CACHE_DIR=tmp_path))
    second = json.loads(run_python(COMPILE, FAGEN_CACHE_DIR=tmp_path))
    assert not first["cached"] and "sympy" in first["heavy"]
    # NVRTC is called without CuPy; CuPy is imported beside it only where the kernel is for this machine's GPU
    assert ("cupy" in first["heavy"]) == (request.detect_arch() == "sm_90a")
    assert "networkx" not in first["heavy"]  # the IR orders its graph with graphlib: compiling needs no networkx
    assert second["cached"] and second["heavy"] == []
    for field in ("name", "spec", "source", "scale", "cubin", "reason"):
        assert second[field] == first[field], field


def test_cached_kernel_matches_a_fresh_compile(tmp_path):
    kw = dict(causal=True, alibi=True, dtype="bf16", arch="sm_90a", cache_dir=tmp_path)
    cold = fagen.compile(64, **kw)
    hit = fagen.compile(64, scale=0.5, **kw)
    assert hit.binary.cached and hit.binary.cubin == cold.binary.cubin
    assert (hit.name, hit.spec, hit.source, hit.tier_reason) == (cold.name, cold.spec, cold.source, cold.tier_reason)
    assert hit.tensors == cold.tensors == ("slopes",) and hit.tensor_index == {"slopes": "h"}
    assert hit.default_scale == 0.5 and cold.default_scale == pytest.approx(64**-0.5)
    assert callable(hit._program)  # parsed only when asked for
    assert str(hit.program) == str(cold.program) and hit.program.name == cold.program.name
    # the simt fallback of a cached kernel is the same kernel as that of a fresh one
    assert (
        hit.fallback_tier().source == cold.fallback_tier().source
        and hit.fallback_tier().spec.tier == cold.fallback_tier().spec.tier
    )
    assert len(list((tmp_path / "compiled").glob("*.json"))) == 2  # the simt fallback has its own entry


def test_entry_records_the_proofs(tmp_path):
    fagen.compile(64, causal=True, dtype="f16", arch="sm_90a", cache_dir=tmp_path)
    (path,) = (tmp_path / "compiled").glob("*.json")
    entry = json.loads(path.read_text())
    names = [p.split(":", 1)[0] for p in entry["proofs"]]
    assert "(a) row sum" in names and "(b) associative" in names and "(c) scores" in names
    assert entry["versions"]["sympy"] == cache.sympy_version() and entry["versions"]["fagen"] == fagen.__version__


def test_corrupt_entries_are_rebuilt(tmp_path):
    kw = dict(causal=True, dtype="f16", arch="sm_90a", cache_dir=tmp_path)
    first = fagen.compile(64, **kw)
    (path,) = (tmp_path / "compiled").glob("*.json")
    edited = path.read_text().replace('"source": "', '"source": "// edited\\n', 1)  # fails its hash
    for garbage in ("{not json", json.dumps({"key": "x"}), edited):
        path.write_text(garbage)
        again = fagen.compile(64, **kw)
        assert again.source == first.source
        assert json.loads(path.read_text())["launches"][0]["source"] == first.source  # the entry was written anew
    # a corrupt cubin behind a valid entry: the entry is not used, the cubin is rebuilt
    (cubin,) = tmp_path.glob("*.cubin")
    cubin.write_bytes(b"garbage")
    rebuilt = fagen.compile(64, **kw)
    assert not rebuilt.binary.cached and rebuilt.binary.cubin == first.binary.cubin
    assert fagen.compile(64, **kw).binary.cached


def test_a_changed_fagen_or_sympy_version_misses(tmp_path, monkeypatch):
    req = request.for_compile(64, causal=True, dtype="f16", arch="sm_90a").cache_key()
    fagen.compile(64, causal=True, dtype="f16", arch="sm_90a", cache_dir=tmp_path)
    assert cache.load(req, tmp_path) is not None
    key = cache.key(req)
    monkeypatch.setattr(cache, "__version__", "0.0.0-other")
    assert cache.key(req) != key and cache.load(req, tmp_path) is None
    monkeypatch.undo()
    monkeypatch.setattr(cache, "sympy_version", lambda: "0.1-other")
    assert cache.key(req) != key and cache.load(req, tmp_path) is None
    monkeypatch.undo()
    monkeypatch.setattr(cache, "fingerprint", lambda: "edited-template")
    assert cache.key(req) != key and cache.load(req, tmp_path) is None


def test_a_changed_tier_setting_misses(tmp_path, monkeypatch):
    """A tier's module setting set in the process (as `bench/ab.py --set` does) is part of the key: the kernel built
    under the other value is not read back, and the entry of the first value still is once it is set back."""
    from fagen.backend.tiers import wgmma

    kw = dict(causal=True, dtype="bf16", arch="sm_90a", cache_dir=tmp_path)
    first = fagen.compile(128, **kw)
    assert f"L2_KV_BYTES = {wgmma.L2_KV_BYTES};" in first.source
    monkeypatch.setattr(wgmma, "L2_KV_BYTES", 12345678)
    other = fagen.compile(128, **kw)
    assert "L2_KV_BYTES = 12345678;" in other.source and not other.binary.cached
    monkeypatch.undo()
    again = fagen.compile(128, **kw)
    assert again.source == first.source and again.binary.cached


def test_sympy_version_is_read_without_importing_sympy():
    out = run_python("from fagen import cache; import sys; print(cache.sympy_version(), 'sympy' in sys.modules)")
    import sympy

    assert out.split() == [sympy.__version__, "False"]


def test_use_cache_false_bypasses_and_writes_nothing(tmp_path):
    k = fagen.compile(64, dtype="f16", arch="sm_90a", cache_dir=tmp_path, use_cache=False)
    assert not k.binary.cached and not list(tmp_path.iterdir())


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path))
    fagen.compile(64, dtype="f16", arch="sm_90a")
    assert len(list((tmp_path / "compiled").glob("*.json"))) == 1


def test_requests_that_differ_get_different_keys():
    def req(**opts):
        return cache.key(request.for_compile(64, dtype="bf16", arch="sm_90a", **opts).cache_key())

    keys = {
        req(),
        req(causal=True),
        req(causal="bottom_right"),
        req(softcap=30),
        req(softcap=30.5),
        req(window=256),
        req(window=(256, 0)),
        req(alibi=True),
        req(prefix=4),
    }
    assert len(keys) == 9
    assert request.for_compile(64, window=object(), arch="sm_90a").cache_key() is None  # not a plain value
    assert cache.request(64, "bf16", "sm_90a", None, None) is None
    text = "program p\n"
    assert request.for_compile(64, ir=text, arch="sm_90a").cache_key()["program"] == {"ir": text}


def test_traced_functions_are_traced_then_hit(tmp_path):
    kw = dict(score_mod=lambda s, b, h, q, k: 20 * fagen.tanh(s / 20), dtype="f16", arch="sm_90a", cache_dir=tmp_path)
    first = fagen.compile(64, **kw)
    second = fagen.compile(64, **kw)
    assert not first.binary.cached and second.binary.cached and second.source == first.source


DECODE_AND_BACKWARD = (
    "import fagen, hashlib, json, sys\n"
    "d = fagen.compile(64, causal=True, window=100, decode=True, dtype='f16', arch='sm_90a')\n"
    "f = fagen.compile(64, causal=True, alibi=True, dtype='f16', arch='sm_90a')\n"
    "b = f.backward_plan\n"
    "digest = lambda launches: [(x.spec.name, hashlib.sha256(x.source.encode()).hexdigest(),\n"
    "    hashlib.sha256(x.binary.cubin).hexdigest(), x.binary.cached) for x in launches]\n"
    "print(json.dumps(dict(decode=digest(d.plan.launches), per_sm=d.plan.blocks_per_sm, scale=d.default_scale,\n"
    "    decode_proofs=list(d.proofs), reason=d.tier_reason,\n"
    "    backward=digest((b.preprocess, b.main, b.convert, b.dq)), gradients=b.gradients, scatters=b.scatters,\n"
    "    backward_proofs=list(b.proofs), heavy=sorted(m for m in ('sympy', 'jinja2', 'cupy') if m in sys.modules))))"
)


def test_decode_ops_and_backward_plans_hit_in_a_fresh_process_without_sympy(tmp_path):
    """The compile cache keeps a decode op (its split kernel) and a forward kernel's backward (its four
    kernels, the tensor gradients' slots and the proofs) whole: a second process gets them without SymPy, the same
    kernels, from the cached cubins."""
    first = json.loads(run_python(DECODE_AND_BACKWARD, FAGEN_CACHE_DIR=tmp_path))
    second = json.loads(run_python(DECODE_AND_BACKWARD, FAGEN_CACHE_DIR=tmp_path))
    assert "sympy" in first["heavy"] and second["heavy"] == []
    assert not any(x[3] for x in first["decode"] + first["backward"])
    assert all(x[3] for x in second["decode"] + second["backward"])
    strip = lambda launches: [x[:3] for x in launches]  # noqa: E731
    for field in ("decode", "backward"):
        assert strip(second[field]) == strip(first[field]), field
    for field in ("per_sm", "scale", "decode_proofs", "reason", "gradients", "scatters", "backward_proofs"):
        assert second[field] == first[field], field
    assert any("merge" in p for p in first["decode_proofs"]) and first["gradients"] == [["slopes", "h"]]
