"""`fagen bench --context-parallel`: fagen's ring (fagen.ring_attention) on W GPUs of one host against one GPU and
against PyTorch's ring (torch.distributed.tensor.experimental.context_parallel, SDPA's cuDNN backend), forward +
backward, bf16, d128, 32 heads, batch 1; it spawns its own W processes (NCCL), one a GPU.

For each W of --gpus, with n = --seqlen tokens per GPU (default 64k: 128k tokens on 2 GPUs, 256k on 4):
- causal over W·n tokens, zigzag: fagen's ring and torch's context_parallel (cuDNN) on the same sequence, against
  fagen.attention on one GPU over the whole sequence (the speedup; efficiency = speedup / W) and over n tokens
  (the same per-GPU tokens: the ring's TFLOP/s per GPU over one GPU's);
- with --window L (default 4096): causal + window over 2n tokens a GPU, contiguous, the ring pruned to its left
  neighbour, against the same window on one GPU's shard (2n tokens): the pruned ring's cost ratio.
Then the model of fagen.ring.model from the measured step time and P2P bandwidth, for 8 to 64 GPUs.

FLOPs: 4·H·D·(visible query-key pairs) for the forward, 3.5x that for forward + backward (FlashAttention's count).
Times: each rank's median over --rounds timed passes (after warm-up), the slowest rank's; fagen's ring and torch's
two K/V rotations are timed in turn, round by round in rotated order (BENCH.md), so that drift between them (clocks,
heat) falls on all three alike.
"""

from __future__ import annotations

import os
import sys
import time

from ...ring import NCCL_SAFE_ENV, OVERLAP_ENV

HEADS, DIM = 32, 128
WARMUP = 2
ROTATIONS = ("allgather", "alltoall")  # torch's K/V rotations (set_rotate_method); allgather is its default
PEER_TOLERANCE = 0.05  # torch's output may differ from fagen's ring by bf16 rounding, not by a wrong result
# dense bf16 peaks (TFLOP/s, the vendors' figures without sparsity), by a part of torch.cuda.get_device_name()
PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756),
    ("H100 NVL", 835),
    ("GH200", 989),
    ("H200", 989),
    ("H100", 989),
    ("H800", 989),
    ("B200", 2250),
    ("A100", 312),
)


def peak_tflops(gpu: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s; None where this table does not know it."""
    return next((value for part, value in PEAKS if part in gpu), None)


def pairs(tokens: int, window: int | None = None) -> int:
    """Query-key pairs a causal mask (with a left window of `window` keys) keeps over `tokens` tokens."""
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return (window + 1) * (window + 2) // 2 + (tokens - window - 1) * (window + 1)


def tflops(tokens: int, seconds: float, window: int | None = None, gpus: int = 1) -> float:
    return 3.5 * 4 * HEADS * DIM * pairs(tokens, window) / seconds / gpus / 1e12


def _timed(torch, fn, rounds: int) -> float:
    """The median seconds of fn over `rounds` passes after warm-up, the slowest rank's (all ranks in step)."""
    return _timed_in_turn(torch, {"fn": fn}, rounds)["fn"]


def rotated(names, rounds: int) -> list[tuple]:
    """The order of each round's timed passes: round i starts at the i-th name (mod their number), so that none
    always runs first or right after another (BENCH.md: several rounds in rotated order)."""
    names = tuple(names)
    return [names[i % len(names) :] + names[: i % len(names)] for i in range(rounds)]


def _timed_in_turn(torch, steps: dict, rounds: int) -> dict:
    """{name: the median seconds of steps[name]} over `rounds` rounds after warm-up, each round timing every step once
    in rotated order (each pass between a barrier and a synchronize), the slowest rank's median."""
    dist = torch.distributed
    for fn in steps.values():
        for _ in range(WARMUP):
            fn()
    times: dict = {name: [] for name in steps}
    for order in rotated(steps, rounds):
        for name in order:
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps[name]()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    t = torch.tensor([sorted(x)[len(x) // 2] for x in times.values()], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(times, t.tolist()))


def _inputs(torch, tokens: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, HEADS, tokens, DIM, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def _agreed(torch, ok: bool) -> bool:
    """Whether `ok` holds on every rank (every rank calls this, each with its own)."""
    flag = torch.tensor([1 if ok else 0], device="cuda", dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _ring_step(torch, tokens: int, layout: str, **opts):
    """One forward + backward of fagen's ring over `tokens` tokens (this rank's shard of fresh inputs)."""
    import fagen
    from fagen import ring

    q, k, v, do = (ring.shard(x, layout=layout) for x in _inputs(torch, tokens))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    def step():
        q.grad = k.grad = v.grad = None
        fagen.ring_attention(q, k, v, layout=layout, **opts).backward(do)

    return step


def _ring_output(torch, tokens: int):
    """fagen's ring's forward output on this rank's zigzag shard (no grad): what torch's peer is checked against."""
    import fagen
    from fagen import ring

    q, k, v, _ = (ring.shard(x, layout="zigzag") for x in _inputs(torch, tokens))
    with torch.no_grad():
        return fagen.ring_attention(q, k, v, causal=True, layout="zigzag")


def _torch_cp(torch, tokens: int, world: int, rounds: int, expect, ring_steps: dict) -> dict:
    """torch's context_parallel as its documentation and its own test (test/distributed/tensor/test_attention.py)
    use it: the buffers q, k, v, dO (none requiring grad when sharded) sharded in place along dim 2 by the context
    (buffer_seq_dims), not restored after it (no_restore_buffers), with its default head-tail load balancing for
    is_causal=True (rank r holds chunks r and 2W-1-r: fagen's zigzag layout, the same tokens as the ring's shards);
    q, k, v then made to require grad in place inside the context; F.scaled_dot_product_attention looked up inside
    the context (it patches the module's function: a reference taken before would run each GPU's shard alone) under
    sdpa_kernel(CUDNN_ATTENTION) (no fallback: an ineligible input raises). Both K/V rotations (set_rotate_method:
    'allgather', torch's default, and 'alltoall') are timed in turn with fagen's ring (`ring_steps`, by name), round
    by round in rotated order: {'ring': seconds, rotation: seconds, ...}, 'error', the forward output's
    max |o - o_fagen| / max |o_fagen| against fagen's ring on the same shard (`expect`), and 'failed', the rotations
    that raised on some rank (their trial pass, before the timing; a failure inside the timed rounds is not caught
    there)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cp
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    saved = (cp._cp_options.enable_load_balance, cp._cp_options.rotate_method)
    out: dict = {}
    buffers = _inputs(torch, tokens)
    try:
        cp._cp_options.enable_load_balance = True  # its default; head-tail balancing needs is_causal=True
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
            q, k, v, do = buffers
            for x in (q, k, v):
                x.requires_grad_(True)

            def attend():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def torch_step(rotation: str):
                def step():
                    cp.set_rotate_method(rotation)
                    q.grad = k.grad = v.grad = None
                    attend().backward(do)

                return step

            steps = dict(ring_steps)
            for rotation in ROTATIONS:  # one rotation failing leaves the other's figure
                # tried on every rank, and timed only where every rank ran it (`agreed`: the same collectives on all)
                diff, why, step = torch.zeros((), device="cuda"), None, torch_step(rotation)
                try:
                    cp.set_rotate_method(rotation)
                    with torch.no_grad():
                        diff = (attend().float() - expect.float()).abs().max() / expect.float().abs().max()
                    step()
                except Exception as e:
                    why = f"{rotation}: {type(e).__name__}: {e}"[:200]
                if not _agreed(torch, why is None):
                    out.setdefault("failed", []).append(why or f"{rotation}: failed on another rank")
                    continue
                torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
                out.setdefault("error", float(diff))
                steps[rotation] = step
            expect = None  # (not held through the timing)
            out.update(_timed_in_turn(torch, steps, rounds))
    finally:
        cp._cp_options.enable_load_balance, cp._cp_options.rotate_method = saved
    return out


def _one_gpu(torch, tokens: int, rounds: int, **opts) -> float:
    """fagen.attention on this rank's GPU alone (the others wait at the barrier of _timed's all_reduce)."""
    import fagen

    q, k, v, do = _inputs(torch, tokens)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))

    def step():
        q.grad = k.grad = v.grad = None
        fagen.attention(q, k, v, **opts).backward(do)

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _p2p_bandwidth(torch, rank: int) -> float:
    """Bytes/s of one 256 MiB send from rank 0 to rank 1 (the link the ring's steps use), the median of 5."""
    dist = torch.distributed
    x = torch.empty(128 << 20, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(6):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(times[1:])[2]], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return x.numel() * 2 / float(t)


def _measure(torch, rank: int, world: int, per_gpu: int, window: int | None, rounds: int, peer: bool) -> dict:
    total = per_gpu * world
    out: dict = {"world": world, "tokens": total, "per_gpu": per_gpu}
    out["gpu"] = torch.cuda.get_device_name()
    ring_step = _ring_step(torch, total, "zigzag", causal=True)
    # the ring on its default links (copy engines on one host) and on NCCL's, timed in turn
    steps = {"ring": ring_step, "ring_nccl": _ring_step(torch, total, "zigzag", causal=True, transport="nccl")}
    if peer:
        try:
            found = _torch_cp(torch, total, world, rounds, _ring_output(torch, total), steps)
            out["ring"], out["ring_nccl"] = found.pop("ring"), found.pop("ring_nccl")
            failed = found.pop("failed", [])
            if "error" in found:
                out["torch_cp_error"] = found.pop("error")
            if found:
                out["torch_cp_rotation"] = min(found, key=lambda rotation: found[rotation])
                out["torch_cp"], out["torch_cp_times"] = found[out["torch_cp_rotation"]], found
            if failed:
                out["torch_cp_failed"] = "; ".join(failed)
        except Exception as e:  # reported in the table, not fatal
            out["torch_cp_failed"] = f"{type(e).__name__}: {e}"[:200]
    if "ring" not in out:  # no peer, or its setup failed before the timing
        out.update(_timed_in_turn(torch, steps, rounds))
    del ring_step, steps  # their inputs and gradients
    if window:
        out["window"], out["window_tokens"] = window, 2 * total
        window_step = _ring_step(torch, 2 * total, "contiguous", causal=True, window=window)
        out["ring_window"] = _timed(torch, window_step, rounds)
    out["bandwidth"] = _p2p_bandwidth(torch, rank)
    torch.distributed.barrier()
    if rank == 0:
        out["one_whole"] = _one_gpu(torch, total, rounds, causal=True)
        out["one_shard"] = _one_gpu(torch, per_gpu, rounds, causal=True)
        if window:
            out["one_window_shard"] = _one_gpu(torch, 2 * per_gpu, rounds, causal=True, window=window)
    return out


def _rank(rank: int, world: int, port: int, config: dict, queue) -> None:
    import traceback

    import torch

    try:
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=torch.device(rank)
        )
        out = _measure(torch, rank, world, **config)
        if rank == 0:
            queue.put(out)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:
        queue.put({"world": world, "error": f"rank {rank}: {traceback.format_exc()}"})


def kernels(world: int, per_gpu: int, window: int | None) -> list[dict]:
    """Every kernel a run for W = `world` compiles, as fagen.compile's options beside the head dim and dtype: the
    ring's piece programs (by their text) and one GPU's (causal; causal with the window)."""
    from fagen import ring

    from ...request import options_source

    jobs: list[tuple[dict, int, str]] = [(dict(causal=True), per_gpu * world, "zigzag")]
    if window:
        jobs.append((dict(causal=True, window=window), 2 * per_gpu * world, "contiguous"))
    out: list[dict] = []
    for opts, total, layout in jobs:
        pieces = ring.split_program(options_source(**opts).build(), total)
        plan = ring.make_plan(pieces, world, layout)
        texts = {str(ring.piece_program(pieces, x)) for row in plan.pieces for g in row for x in g}
        out += [dict(ir=text) for text in sorted(texts)] + [opts]
    return out


def precompile(world: int, per_gpu: int, window: int | None) -> None:
    """Every kernel the ranks run (the ring's piece programs, one GPU's), compiled (forward and backward) into the
    cache before the W processes start, so that they do not compile the same kernels at once."""
    import fagen

    for options in kernels(world, per_gpu, window):
        assert fagen.compile(DIM, dtype="bf16", **options).backward_plan is not None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(environ) -> dict[str, str]:
    """The environment every rank starts with: NVLink multicast off (fagen.ring.NCCL_SAFE_ENV) and one hardware queue
    a GPU (fagen.ring.OVERLAP_ENV), each where `environ` does not set it already (the caller's value wins)."""
    return {**NCCL_SAFE_ENV, **OVERLAP_ENV, **{n: environ[n] for n in (*NCCL_SAFE_ENV, *OVERLAP_ENV) if n in environ}}


def run(worlds, per_gpu: int, window: int | None, rounds: int, peer: bool = True) -> list[dict]:
    """Spawn W processes for each W of `worlds` and return rank 0's measurements (or the error), one dict a W."""
    import multiprocessing as mp

    os.environ.update(rank_env(os.environ))
    ctx = mp.get_context("spawn")
    rows = []
    for world in worlds:
        precompile(world, per_gpu, window)
        queue = ctx.Queue()
        config = dict(per_gpu=per_gpu, window=window, rounds=rounds, peer=peer)
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, config, queue)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            rows.append(queue.get(timeout=1800))
        finally:
            for p in procs:
                p.join(timeout=120)
                if p.is_alive():
                    p.kill()
    return rows


def figures(r: dict) -> dict[str, float]:
    """Each time of a row (rank 0's measurements for one W) as TFLOP/s a GPU, by what was timed."""
    W, T, n = r["world"], r["tokens"], r["per_gpu"]
    out = {"fagen ring": tflops(T, r["ring"], gpus=W)}
    if "torch_cp" in r:
        out["torch CP"] = tflops(T, r["torch_cp"], gpus=W)
    out["one GPU, whole sequence"] = tflops(T, r["one_whole"])
    out["one GPU, one shard"] = tflops(n, r["one_shard"])
    if "ring_window" in r:
        out["pruned ring"] = tflops(r["window_tokens"], r["ring_window"], r["window"], gpus=W)
        out["one GPU, window shard"] = tflops(2 * n, r["one_window_shard"], r["window"])
    return out


def implausible(r: dict) -> dict[str, str]:
    """The figures of a row that cannot be right, by name, each with why: TFLOP/s a GPU past the GPU's peak (a
    harness that times less work than it counts), and torch's output far from fagen's ring's (another attention)."""
    found = {}
    gpu = r.get("gpu", "")
    peak = peak_tflops(gpu)
    for name, value in figures(r).items():
        if peak is not None and value > peak:
            found[name] = f"{value:.0f} TFLOP/s a GPU, past the {gpu}'s peak of {peak:.0f}: not a valid measurement"
    err = r.get("torch_cp_error")
    if "torch_cp" in r and not (err is not None and err <= PEER_TOLERANCE):
        why = "was not checked" if err is None else f"differs from fagen's ring's by {err:.3g} of its largest value"
        found["torch CP output"] = f"{why}: not shown to be the same attention"
    return found


def table(rows: list[dict]) -> list[str]:
    """The results as markdown lines: one row a W for the causal ring and torch's, one for the pruned window, and a
    warning for each figure that cannot be right (its cell marked ⚠)."""
    lines = [
        "| GPUs | tokens | fagen ring ms | tokens/s | TFLOP/s/GPU | × one GPU (whole seq) | efficiency | "
        "per-GPU-token eff. | torch CP (cuDNN) ms | torch rotation, output err | fagen ÷ torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    warnings = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world']} | error: {r['error'].splitlines()[-1][:120]} |")
            continue
        W, T, n = r["world"], r["tokens"], r["per_gpu"]
        bad = implausible(r)
        warnings += [f"- ⚠ {W} GPUs, {name}: {why}" for name, why in bad.items()]
        if "torch_cp_times" in r:
            times = ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in r["torch_cp_times"].items())
            warnings.append(f"- {W} GPUs, torch CP's rotations: {times}")
        if "ring_nccl" in r:
            warnings.append(
                f"- {W} GPUs, fagen ring over NCCL (transport='nccl'): {r['ring_nccl'] * 1e3:.1f} ms, "
                f"{r['ring_nccl'] / r['ring']:.2f}× the ring's default links"
            )
        if "torch_cp" in r and "torch_cp_failed" in r:
            warnings.append(f"- {W} GPUs, torch CP: {r['torch_cp_failed']}")

        def mark(*names, bad=bad):
            return " ⚠" if any(x in bad for x in names) else ""

        speed = r["one_whole"] / r["ring"]
        per_token = tflops(T, r["ring"], gpus=W) / tflops(n, r["one_shard"])
        torch_ms, peer, ratio = r.get("torch_cp_failed", "not run"), "-", "-"
        if "torch_cp" in r:
            torch_ms = f"{r['torch_cp'] * 1e3:.1f}{mark('torch CP')}"
            err = f"{r['torch_cp_error']:.2g}" if "torch_cp_error" in r else "unchecked"
            peer = f"{r['torch_cp_rotation']}, {err}{mark('torch CP output')}"
            ratio = f"{r['torch_cp'] / r['ring']:.2f}×{mark('torch CP', 'torch CP output', 'fagen ring')}"
        lines.append(
            f"| {W} | {T} | {r['ring'] * 1e3:.1f}{mark('fagen ring')} | {T / r['ring']:.3g} | "
            f"{tflops(T, r['ring'], gpus=W):.0f} | {speed:.2f}×{mark('one GPU, whole sequence')} | {speed / W:.0%} | "
            f"{per_token:.0%}{mark('one GPU, one shard')} | {torch_ms} | {peer} | {ratio} |"
        )
    lines += _window_table(rows)
    return lines + (["", *warnings] if warnings else [])


def _window_table(rows: list[dict]) -> list[str]:
    windowed = [r for r in rows if "ring_window" in r]
    if not windowed:
        return []
    lines = [
        "",
        "| GPUs | tokens | window | pruned ring ms | one GPU, one shard ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in windowed:
        W, T, L = r["world"], r["window_tokens"], r["window"]
        bad = implausible(r)
        ring_ms = f"{r['ring_window'] * 1e3:.1f}{' ⚠' if 'pruned ring' in bad else ''}"
        one_ms = f"{r['one_window_shard'] * 1e3:.1f}{' ⚠' if 'one GPU, window shard' in bad else ''}"
        lines.append(f"| {W} | {T} | {L} | {ring_ms} | {one_ms} | {r['ring_window'] / r['one_window_shard']:.2f}× |")
    return lines


def model_lines(rows: list[dict]) -> list[str]:
    """fagen.ring.model from this run's largest W: its per-step time (the ring's time over W steps) and link."""
    from ... import ring

    done = [r for r in rows if "error" not in r]
    if not done:
        return []
    r = max(done, key=lambda x: x["world"])
    step = r["ring"] / r["world"]
    lines = [
        "",
        f"Model (fagen.ring.model) from W = {r['world']}: {step * 1e3:.1f} ms a step of {r['per_gpu']} tokens,",
    ]
    lines[-1] += (
        f" P2P {r['bandwidth'] / 1e9:.0f} GB/s; all-to-all at the same bandwidth within a node, 50 GB/s across."
    )
    lines += ["", *ring.model_table(step_seconds=step, step_tokens=r["per_gpu"], link=r["bandwidth"])]
    return lines


def main(args) -> int:
    import torch

    have = torch.cuda.device_count()
    worlds = [w for w in (args.gpus or (2, 4)) if w <= have]
    if not worlds:
        raise RuntimeError(f"--gpus: this machine has {have} GPU(s); the ring needs at least 2")
    per_gpu = (args.seqlen or (65536,))[0]
    rows = run(worlds, per_gpu, args.window, max(args.rounds, 5))
    title = f"# fagen ring vs one GPU and torch context_parallel (cuDNN): causal d{DIM}, {HEADS} heads, bf16, fwd+bwd"
    gpu = next((r["gpu"] for r in rows if "gpu" in r), "?")
    env = ", ".join(f"{name}={os.environ[name]}" for name in OVERLAP_ENV)
    text = [title, "", f"GPU: {gpu} (peak {peak_tflops(gpu) or '?'} TFLOP/s bf16 dense); every rank: {env}", ""]
    text += table(rows)
    text += model_lines(rows)
    for r in rows:
        for name, why in (implausible(r) if "error" not in r else {}).items():
            print(f"warning: {r['world']} GPUs, {name}: {why}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_parallel.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0 if all("error" not in r for r in rows) else 1
