// fa3_fwd.cu -- standalone FlashAttention-3 style forward kernel for Hopper (sm_90a), bf16, [B, H, N, D].
// Prototype for a fagen tier. No #include: compiles with bare nvcc / NVRTC.
//
// Work split (FlashAttention-3, Shah et al. 2024):
//   warpgroup 0      producer: one thread issues TMA loads of Q_i once and of K_j, V_j into a STAGES-deep
//                    shared-memory ring ("full" mbarriers complete on the bytes landing); setmaxnreg down.
//   warpgroups 1, 2  consumers, 64 query rows each (block of 128 rows); setmaxnreg up. S = Q K^T by wgmma with
//                    both operands in shared memory, online softmax in registers on the accumulator layout,
//                    P -> bf16 in registers, O += P V by wgmma with A from registers and V read transposed
//                    (MN-major descriptor). Each consumer releases a stage through an "empty" mbarrier.
//   OVERLAP          issue S_{j+1} = Q K_{j+1}^T and O += P_j V_j together, softmax of S_{j+1} while PV runs.
//   PINGPONG         two named barriers make the consumer warpgroups take turns issuing their GEMMs, so one's
//                    softmax runs under the other's matmuls.
// Key tiles are visited from the last to the first, so the tiles that need a mask (the seqlen_k edge and
// the causal diagonal) come first and the rest run unmasked.
//
// Conventions (fagen's): scores in base 2 with log2(e) folded into scale_log2; running max m_i kept in
// base-2 units; lse = natural log-sum-exp; a fully masked row gives O = 0 and lse = -inf. Causal is
// bottom-right aligned: key k is visible to query q iff k <= q + seqlen_k - seqlen_q.
//
// Shared memory tiles are stored as the TMA box layout with 128-byte swizzle: a tile of R rows x D columns
// is D/64 column blocks, each [R][64] bf16 (128-byte rows), 16-byte chunk c of row r stored at chunk c ^ (r % 8)
// within each 1024-byte group of 8 rows. Every block starts 1024-byte aligned.

#define FAGEN_INFINITY __int_as_float(0x7f800000U)

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef OVERLAP
#define OVERLAP 1
#endif
#ifndef PINGPONG
#define PINGPONG 1
#endif
#ifndef VDESC_SWAP
#define VDESC_SWAP 0      // 1: swap LBO/SBO of the V descriptor (a debugging alternative)
#endif
#ifndef POLY_EXP_EVERY
#define POLY_EXP_EVERY 0  // > 0: every POLY_EXP_EVERY-th 8-column chunk of S takes 2^x on the FMA pipe, not MUFU
#endif
#ifndef STORE_TMA
#define STORE_TMA 0       // 1: O goes registers -> shared memory (this warpgroup's Q rows) -> TMA bulk store
#endif
#ifndef LAZY_RESCALE
#define LAZY_RESCALE 0    // 1: the running max moves only when a block max passes it by > 8 (log2 units); O is
#endif                    //    rescaled only when some row of the warp moved (fagen's kTau rule)
#ifndef PRODUCER_REGS
#define PRODUCER_REGS 24
#endif
#ifndef CONSUMER_REGS
#define CONSUMER_REGS 240
#endif

namespace {
constexpr int BLOCK_M = 128;                          // query rows per CTA: two consumer warpgroups x 64
constexpr int NUM_THREADS = 384;                      // producer warpgroup + 2 consumer warpgroups
constexpr int DBLK = HEAD_DIM / 64;                   // 64-column (128-byte) blocks per row
constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int KV_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int Q_BLK_BYTES = BLOCK_M * 128;            // one 64-column block of the Q tile
constexpr int KV_BLK_BYTES = BLOCK_N * 128;           // one 64-column block of a K or V tile
constexpr int S_REGS = BLOCK_N / 2;                   // S accumulator floats per thread (m64 x BLOCK_N)
constexpr int O_REGS = HEAD_DIM / 2;                  // O accumulator floats per thread (m64 x HEAD_DIM)
constexpr int OFF_K = Q_BYTES;
constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
constexpr int OFF_BAR = OFF_V + STAGES * KV_BYTES;
[[maybe_unused]] constexpr int OFF_SCRATCH = OFF_BAR + 256;             // mbarriers: full_q, full_k[], full_v[], empty_k[], empty_v[]
constexpr int SMEM_BYTES = OFF_SCRATCH + 4 * 256;       // + one scratch word per consumer thread
static_assert(8 * (2 + 4 * STAGES) <= 256, "mbarrier area");
static_assert(SMEM_BYTES + 1024 <= 227 * 1024, "shared memory (+1024 for the runtime alignment)");
constexpr int BAR_WG_BASE = 8;                         // named barriers 8, 9: pingpong turn of warpgroup 0, 1
static_assert(HEAD_DIM % 64 == 0 && BLOCK_N % 16 == 0 && BLOCK_N <= 256, "tile shape");
static_assert(Q_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "1024-byte alignment of swizzled tiles");
}  // namespace

struct alignas(64) TmaMap { unsigned long long v[16]; };   // CUtensorMap, opaque 128 bytes

// ---- PTX helpers ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {   // generic -> shared-window address
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {   // mbarrier expecting `count` arrivals
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() {   // make mbarrier inits visible to the async proxy (TMA)
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {   // arrive + expect `bytes` of TMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {   // plain arrival (consumer releases a stage)
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {   // spin until phase `parity` completed
    unsigned done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// TMA: box at coordinates (c0 = column, c1 = row, c2 = batch*head) of a 3-D tensor map into shared memory
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, int c0, int c1, int c2, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// TMA: shared-memory box back to global memory (rows past the tensor's end are clipped), as a bulk group
__device__ __forceinline__ void tma_store_3d(const TmaMap* map, unsigned src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void bulk_commit() {   // close the bulk (TMA store) group
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() {   // TMA stores have finished reading shared memory
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {   // TMA stores complete
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {   // plain 4-byte shared store
    asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void prefetch_tma_map(const TmaMap* map) {   // pull the descriptor into the cache
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {   // give registers back (producer)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {   // take registers (consumers)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS));
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {   // wait at hardware barrier `id` (count threads)
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {   // signal barrier `id` without waiting
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {   // order generic smem writes before async-proxy reads
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {   // registers written before here are visible to wgmma
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {   // close the group of wgmmas issued so far
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {   // wait until at most N groups are pending
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// wait_group 0 kept below the softmax: ptxas otherwise schedules the wait right after wait_group 1 and the
// softmax no longer overlaps the PV wgmma. A shared-memory store of a value the softmax produced (`dep`, to a
// per-thread scratch word) pins it; a predicated wait would instead make ptxas serialize all wgmmas (C7514).
__device__ __forceinline__ void wgmma_wait0_after(float dep, unsigned scratch) {
    asm volatile("st.shared.f32 [%0], %1;" :: "r"(scratch), "f"(dep) : "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
template <int R> __device__ __forceinline__ void fence_regs(float (&r)[R]) {   // pin accumulators in program order
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
// wgmma shared-memory matrix descriptor, 128-byte swizzle: start >> 4 in bits 0-13, leading byte offset >> 4
// in 16-29, stride byte offset >> 4 in 32-45, base offset 0 (blocks are 1024-aligned), swizzle mode 1 in 62-63.
__device__ __forceinline__ unsigned long long make_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16 |
           (unsigned long long)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {   // two floats -> bf16x2 (lo in low half)
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float fast_exp2(float x) {   // 2^x on MUFU.EX2; -inf -> 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// 2^x on the FMA/ALU pipes for x <= 0 (relative error < 1e-4, below bf16's 4e-3; 0 for x < -125): relieves
// MUFU, which at d64 is as busy as the tensor cores. round(x) via the 1.5*2^23 trick, 2^f by a cubic on
// [-0.5, 0.5] (relative-error fit), then round(x) added to the exponent field.
__device__ __forceinline__ float poly_exp2(float x) {
    const float t = x + 12582912.0f;
    const float j = t - 12582912.0f;
    const float f = x - j;
    const float p = fmaf(fmaf(fmaf(0.05517098f, f, 0.24260971f), f, 0.69326097f), f, 0.99992818f);
    const int bits = __float_as_int(p) + (__float_as_int(t) << 23);
    return x < -125.0f ? 0.0f : __int_as_float(bits);
}
__device__ __forceinline__ float quad_max(float x) {   // over the 4 lanes that share a row
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// BEGIN GENERATED WGMMA (gen_wgmma.py)
template <int N> struct Wgmma;   // m64nNk16 bf16 -> f32 wgmma, one specialisation per N
template <> struct Wgmma<64> {
    // d (+)= A * B, A = 64x16 and B = 16x64 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[32], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x64 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<80> {
    // d (+)= A * B, A = 64x16 and B = 16x80 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[40], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %42, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x80 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[40], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %45, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, {%40, %41, %42, %43}, %44, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<96> {
    // d (+)= A * B, A = 64x16 and B = 16x96 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[48], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %50, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x96 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[48], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %53, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<112> {
    // d (+)= A * B, A = 64x16 and B = 16x112 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[56], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %58, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, %56, %57, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x112 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[56], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %61, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55}, {%56, %57, %58, %59}, %60, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<128> {
    // d (+)= A * B, A = 64x16 and B = 16x128 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[64], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x128 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[64], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<144> {
    // d (+)= A * B, A = 64x16 and B = 16x144 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[72], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %74, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, %72, %73, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x144 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[72], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %77, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, {%72, %73, %74, %75}, %76, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<160> {
    // d (+)= A * B, A = 64x16 and B = 16x160 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[80], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %82, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, %80, %81, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x160 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[80], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %85, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, {%80, %81, %82, %83}, %84, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<176> {
    // d (+)= A * B, A = 64x16 and B = 16x176 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[88], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %90, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x176 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[88], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %93, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, {%88, %89, %90, %91}, %92, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<192> {
    // d (+)= A * B, A = 64x16 and B = 16x192 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[96], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %98, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x192 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[96], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %101, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
template <> struct Wgmma<256> {
    // d (+)= A * B, A = 64x16 and B = 16x256 both K-major in shared memory (descriptors)
    static __device__ __forceinline__ void ss(float (&d)[128], unsigned long long da, unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "l"(da), "l"(db), "r"(accumulate));
    }
    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x256 MN-major (transposed)
    static __device__ __forceinline__ void rs(float (&d)[128], const unsigned (&a)[4], unsigned long long db, int accumulate) {
        asm volatile("{ .reg .pred p; setp.ne.b32 p, %133, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1; }"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    }
};
// END GENERATED WGMMA

// ---- the tensor-core steps of the algorithm -------------------------------------------------------------
// S = Q_wg K_j^T: k-step kk reads 16 columns of the 64-column block kk/4 (32 bytes further per step inside the
// swizzled 128-byte rows; the hardware applies the swizzle from the address bits). K-major, SBO = 1024 bytes
// between 8-row groups, LBO unused (16).
__device__ __forceinline__ void gemm_qk(float (&S)[S_REGS], unsigned q_tile, unsigned k_tile) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const unsigned long long da = make_desc(q_tile + (kk / 4) * Q_BLK_BYTES + (kk % 4) * 32, 16, 1024);
        const unsigned long long db = make_desc(k_tile + (kk / 4) * KV_BLK_BYTES + (kk % 4) * 32, 16, 1024);
        Wgmma<BLOCK_N>::ss(S, da, db, kk > 0);
    }
}
// O += P V_j: k-step kk covers keys [16 kk, 16 kk + 16) = two 8-row groups (2048 bytes). V is MN-major
// for this product (d contiguous): LBO = bytes between 64-column blocks, SBO = bytes between 8-key groups.
__device__ __forceinline__ void gemm_pv(float (&O)[O_REGS], const unsigned (&P)[BLOCK_N / 16][4], unsigned v_tile, int accumulate) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#if VDESC_SWAP
        const unsigned long long db = make_desc(v_tile + kk * 2048, 1024, KV_BLK_BYTES);
#else
        const unsigned long long db = make_desc(v_tile + kk * 2048, KV_BLK_BYTES, 1024);
#endif
        Wgmma<HEAD_DIM>::rs(O, P[kk], db, accumulate || kk > 0);
    }
}

// ---- softmax pieces on the wgmma accumulator layout -------------------------------------------------------
// Accumulator element 4 i + e of a thread (warp w of the warpgroup, lane l): row 16 w + l / 4 + 8 (e / 2),
// column 8 i + 2 (l % 4) + e % 2. Rows "half 0" (e = 0, 1) and "half 1" (e = 2, 3).
__device__ __forceinline__ void apply_mask(float (&S)[S_REGS], int q_idx0, int n0, int seqlen_k, int causal_off, bool causal, int lane) {
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k_idx = n0 + 8 * i + 2 * (lane % 4) + (e & 1);
            const int q_idx = q_idx0 + 8 * (e >> 1);
            if (k_idx >= seqlen_k || (causal && k_idx > q_idx + causal_off)) S[4 * i + e] = -FAGEN_INFINITY;
        }
}
// Online softmax: m (base 2), per-thread partial l, S -> P = 2^(S scale_log2 - m) in place; returns alpha.
__device__ __forceinline__ void softmax_step(float (&S)[S_REGS], float (&m)[2], float (&l)[2], float (&alpha)[2], float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = -FAGEN_INFINITY;
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i) mx = fmaxf(mx, fmaxf(S[4 * i + 2 * h], S[4 * i + 2 * h + 1]));
        mx = quad_max(mx) * scale_log2;
        const float m_new = (LAZY_RESCALE && mx <= m[h] + 8.0f) ? m[h] : fmaxf(m[h], mx);   // P stays <= 2^8
        const float m_use = m_new == -FAGEN_INFINITY ? 0.0f : m_new;   // no -inf - -inf = NaN
        alpha[h] = fast_exp2(m[h] - m_use);
        m[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < BLOCK_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = fmaf(S[4 * i + 2 * h + e], scale_log2, -m_use);
                const float p = (POLY_EXP_EVERY > 0 && i % (POLY_EXP_EVERY > 0 ? POLY_EXP_EVERY : 1) == POLY_EXP_EVERY - 1) ? poly_exp2(x) : fast_exp2(x);
                S[4 * i + 2 * h + e] = p;
                sum += p;
            }
        l[h] = l[h] * alpha[h] + sum;
    }
}
__device__ __forceinline__ void rescale_o(float (&O)[O_REGS], const float (&alpha)[2]) {
    if (LAZY_RESCALE && !__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) return;   // no row moved
#pragma unroll
    for (int i = 0; i < O_REGS; ++i) O[i] *= alpha[(i >> 1) & 1];
}
// P as wgmma A fragments: k-step kk is accumulator columns [16 kk, 16 kk + 16) = chunks 2 kk, 2 kk + 1.
__device__ __forceinline__ void convert_p(const float (&S)[S_REGS], unsigned (&P)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        P[kk][0] = pack_bf16(S[8 * kk + 0], S[8 * kk + 1]);
        P[kk][1] = pack_bf16(S[8 * kk + 2], S[8 * kk + 3]);
        P[kk][2] = pack_bf16(S[8 * kk + 4], S[8 * kk + 5]);
        P[kk][3] = pack_bf16(S[8 * kk + 6], S[8 * kk + 7]);
    }
}

// The CTA's work items ("tiles": 128 query rows of one batch*head) in order t = blockIdx.x, + gridDim.x, ...
// (persistent when gridDim.x < the tile count). Tiles are numbered head-major so that the CTAs running at the
// same time share K and V in L2; within a head, causal takes the long rows first.
struct Tile { int q_lo, bh, n_tiles; };
__device__ __forceinline__ Tile decode_tile(int t, int num_m, int seqlen_q, int seqlen_k, bool causal) {
    Tile r;
    r.bh = t / num_m;
    const int m_block = causal ? num_m - 1 - t % num_m : t % num_m;
    r.q_lo = m_block * BLOCK_M;
    int n_end = seqlen_k;
    if (causal) n_end = min(n_end, r.q_lo + BLOCK_M + seqlen_k - seqlen_q);   // keys right of the last row's diagonal
    r.n_tiles = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
    return r;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
fa3_fwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map,
        const __grid_constant__ TmaMap o_map, unsigned short* __restrict__ o, float* __restrict__ lse, int seqlen_q, int seqlen_k, int num_bh, float scale_log2,
        int causal_flag)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;   // swizzled tiles need 1024-byte alignment
    const unsigned Q_s = base;
    const unsigned K_s = base + OFF_K;
    const unsigned V_s = base + OFF_V;
    const unsigned full_q = base + OFF_BAR;             // Q landed
    const unsigned empty_q = full_q + 8;                // both consumer warpgroups done reading Q (all S computed)
    const unsigned full_k = full_q + 16;                // [STAGES]
    const unsigned full_v = full_k + 8 * STAGES;        // [STAGES]
    const unsigned empty_k = full_v + 8 * STAGES;       // [STAGES]: K of a stage consumed (S computed)
    const unsigned empty_v = empty_k + 8 * STAGES;      // [STAGES]: V of a stage consumed (PV computed)

    const bool causal = causal_flag != 0;
    const int causal_off = seqlen_k - seqlen_q;
    const int num_m = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int total_tiles = num_m * num_bh;

    const int warp_group = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        mbar_init(empty_q, 256);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_k + 8 * s, 1);
            mbar_init(full_v + 8 * s, 1);
            mbar_init(empty_k + 8 * s, 256);   // every consumer thread arrives
            mbar_init(empty_v + 8 * s, 256);
        }
        fence_mbar_init();
    }
    __syncthreads();

    if (warp_group == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            prefetch_tma_map(&q_map);
            prefetch_tma_map(&k_map);
            prefetch_tma_map(&v_map);
            int kv_iter = 0, q_iter = 0;                 // K/V tiles and Q tiles loaded so far by this CTA
            for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
                const Tile tile = decode_tile(t, num_m, seqlen_q, seqlen_k, causal);
                if (tile.n_tiles == 0) continue;
                if (q_iter > 0) mbar_wait(empty_q, (q_iter - 1) & 1);   // consumers finished with the previous Q
                mbar_arrive_expect_tx(full_q, Q_BYTES);
#pragma unroll
                for (int c = 0; c < DBLK; ++c) tma_load_3d(Q_s + c * Q_BLK_BYTES, &q_map, 64 * c, tile.q_lo, tile.bh, full_q);
                ++q_iter;
                for (int it = 0; it < tile.n_tiles; ++it, ++kv_iter) {
                    const int stage = kv_iter % STAGES;
                    const unsigned parity = ((kv_iter / STAGES) + 1) & 1;   // phase completed by the previous use
                    const int n0 = (tile.n_tiles - 1 - it) * BLOCK_N;
                    if (kv_iter >= STAGES) mbar_wait(empty_k + 8 * stage, parity);
                    mbar_arrive_expect_tx(full_k + 8 * stage, KV_BYTES);
#pragma unroll
                    for (int c = 0; c < DBLK; ++c)
                        tma_load_3d(K_s + stage * KV_BYTES + c * KV_BLK_BYTES, &k_map, 64 * c, n0, tile.bh, full_k + 8 * stage);
                    if (kv_iter >= STAGES) mbar_wait(empty_v + 8 * stage, parity);
                    mbar_arrive_expect_tx(full_v + 8 * stage, KV_BYTES);
#pragma unroll
                    for (int c = 0; c < DBLK; ++c)
                        tma_load_3d(V_s + stage * KV_BYTES + c * KV_BLK_BYTES, &v_map, 64 * c, n0, tile.bh, full_v + 8 * stage);
                }
            }
        }
    } else {
        // ---------------- consumers ----------------
        setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = warp_group - 1;                        // 0 or 1: rows [64 wg, 64 wg + 64) of the block
        const int lane = threadIdx.x % 32;
        const int warp_in_wg = (threadIdx.x / 32) % 4;
        const int row_in_block = wg * 64 + warp_in_wg * 16 + lane / 4;   // half 0; half 1 is + 8
        const unsigned q_tile = Q_s + wg * 64 * 128;          // this warpgroup's 64 rows of every Q column block
        const unsigned scratch = base + OFF_SCRATCH + 4 * (threadIdx.x - 128);
        int kv_iter = 0, q_iter = 0;

        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
            const Tile tile = decode_tile(t, num_m, seqlen_q, seqlen_k, causal);
            const int n_tiles = tile.n_tiles, q_lo = tile.q_lo;
            const int q_idx0 = q_lo + row_in_block;
            float O[O_REGS];
#pragma unroll
            for (int i = 0; i < O_REGS; ++i) O[i] = 0.0f;
            float m[2] = {-FAGEN_INFINITY, -FAGEN_INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];
            float S[S_REGS];
            unsigned P[BLOCK_N / 16][4];

            if (n_tiles > 0) {
#if PINGPONG
                if (wg == 1) named_bar_arrive(BAR_WG_BASE + 0, 256);   // warpgroup 0 issues first
#endif
                mbar_wait(full_q, q_iter & 1);
                // mask needed: tile crosses seqlen_k or (causal) holds a key right of this block's first diagonal
                auto needs_mask = [&](int n0) { return n0 + BLOCK_N > seqlen_k || (causal && n0 + BLOCK_N - 1 > q_lo + causal_off); };
#if OVERLAP
                {   // first tile: S alone
                    const int stage = kv_iter % STAGES;
                    const int n0 = (n_tiles - 1) * BLOCK_N;
                    mbar_wait(full_k + 8 * stage, (kv_iter / STAGES) & 1);
#if PINGPONG
                    named_bar_sync(BAR_WG_BASE + wg, 256);
#endif
                    wgmma_fence();
                    gemm_qk(S, q_tile, K_s + stage * KV_BYTES);
                    wgmma_commit();
#if PINGPONG
                    named_bar_arrive(BAR_WG_BASE + (wg ^ 1), 256);
#endif
                    wgmma_wait<0>();
                    fence_regs(S);
                    mbar_arrive(empty_k + 8 * stage);
                    if (needs_mask(n0)) apply_mask(S, q_idx0, n0, seqlen_k, causal_off, causal, lane);
                    softmax_step(S, m, l, alpha, scale_log2);
                    convert_p(S, P);
                }
                for (int it = 1; it < n_tiles; ++it) {
                    const int g = kv_iter + it;                       // this CTA's running K/V tile count
                    const int stage = g % STAGES, prev = (g - 1) % STAGES;
                    const int n0 = (n_tiles - 1 - it) * BLOCK_N;
                    mbar_wait(full_k + 8 * stage, (g / STAGES) & 1);
#if PINGPONG
                    named_bar_sync(BAR_WG_BASE + wg, 256);
#endif
                    fence_regs(O);
                    wgmma_fence();
                    gemm_qk(S, q_tile, K_s + stage * KV_BYTES);
                    wgmma_commit();
                    mbar_wait(full_v + 8 * prev, ((g - 1) / STAGES) & 1);
                    gemm_pv(O, P, V_s + prev * KV_BYTES, it > 1);
                    wgmma_commit();
#if PINGPONG
                    named_bar_arrive(BAR_WG_BASE + (wg ^ 1), 256);
#endif
                    wgmma_wait<1>();                                  // S done, PV may still run
                    fence_regs(S);
                    mbar_arrive(empty_k + 8 * stage);
                    if (needs_mask(n0)) apply_mask(S, q_idx0, n0, seqlen_k, causal_off, causal, lane);
                    softmax_step(S, m, l, alpha, scale_log2);
                    wgmma_wait0_after(l[0] + l[1], scratch);          // PV done (after the softmax): O, stage prev free
                    fence_regs(O);
                    mbar_arrive(empty_v + 8 * prev);
                    rescale_o(O, alpha);
                    convert_p(S, P);
                }
#if !STORE_TMA
                mbar_arrive(empty_q);                                 // every S of this tile is computed: Q is free
#endif
                {   // last PV
                    const int g = kv_iter + n_tiles - 1;
                    const int prev = g % STAGES;
                    mbar_wait(full_v + 8 * prev, (g / STAGES) & 1);
#if PINGPONG
                    named_bar_sync(BAR_WG_BASE + wg, 256);
#endif
                    fence_regs(O);
                    wgmma_fence();
                    gemm_pv(O, P, V_s + prev * KV_BYTES, n_tiles > 1);
                    wgmma_commit();
#if PINGPONG
                    if (wg == 0) named_bar_arrive(BAR_WG_BASE + 1, 256);   // warpgroup 1's last turn needs no successor
#endif
                    wgmma_wait<0>();
                    fence_regs(O);
                    mbar_arrive(empty_v + 8 * prev);
                }
#else
                for (int it = 0; it < n_tiles; ++it) {
                    const int g = kv_iter + it;
                    const int stage = g % STAGES;
                    const unsigned parity = (g / STAGES) & 1;
                    const int n0 = (n_tiles - 1 - it) * BLOCK_N;
                    mbar_wait(full_k + 8 * stage, parity);
#if PINGPONG
                    named_bar_sync(BAR_WG_BASE + wg, 256);
#endif
                    wgmma_fence();
                    gemm_qk(S, q_tile, K_s + stage * KV_BYTES);
                    wgmma_commit();
#if PINGPONG
                    if (!(wg == 1 && it == n_tiles - 1)) named_bar_arrive(BAR_WG_BASE + (wg ^ 1), 256);
#endif
                    wgmma_wait<0>();
                    fence_regs(S);
                    mbar_arrive(empty_k + 8 * stage);
#if !STORE_TMA
                    if (it == n_tiles - 1) mbar_arrive(empty_q);
#endif
                    if (needs_mask(n0)) apply_mask(S, q_idx0, n0, seqlen_k, causal_off, causal, lane);
                    softmax_step(S, m, l, alpha, scale_log2);
                    rescale_o(O, alpha);
                    convert_p(S, P);
                    mbar_wait(full_v + 8 * stage, parity);
                    fence_regs(O);
                    wgmma_fence();
                    gemm_pv(O, P, V_s + stage * KV_BYTES, 1);
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_regs(O);
                    mbar_arrive(empty_v + 8 * stage);
                }
#endif
                kv_iter += n_tiles;
                ++q_iter;
            }

            // ---------------- epilogue: O / l and lse ----------------
            const long long row_base = (long long)tile.bh * seqlen_q;
            float inv_l[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                l[h] = quad_sum(l[h]);
                inv_l[h] = l[h] == 0.0f ? 0.0f : 1.0f / l[h];   // fully masked row: O = 0
            }
#if STORE_TMA
            if (n_tiles > 0) {   // O tile -> this warpgroup's (now unused) Q rows, 128B-swizzled like a TMA box -> TMA store
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = warp_in_wg * 16 + lane / 4 + 8 * h;   // row within the warpgroup's 64
#pragma unroll
                    for (int i = 0; i < HEAD_DIM / 8; ++i)
                        st_shared_u32(q_tile + (i / 8) * Q_BLK_BYTES + r * 128 + (((i % 8) ^ (r % 8)) * 16) + (lane % 4) * 4,
                                      pack_bf16(O[4 * i + 2 * h] * inv_l[h], O[4 * i + 2 * h + 1] * inv_l[h]));
                }
                fence_proxy_async();                               // generic-proxy writes -> visible to the TMA engine
                named_bar_sync(BAR_WG_BASE + 2 + wg, 128);         // the whole warpgroup's tile is in shared memory
                if (warp_in_wg == 0 && lane == 0) {
#pragma unroll
                    for (int c = 0; c < DBLK; ++c) tma_store_3d(&o_map, q_tile + c * Q_BLK_BYTES, 64 * c, q_lo + wg * 64, tile.bh);
                    bulk_commit();
                    bulk_wait_read();                              // shared memory read: Q rows may be refilled
                }
                mbar_arrive(empty_q);
            }
#endif
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float lsum = l[h];
                const int q_idx = q_idx0 + 8 * h;
                if (q_idx >= seqlen_q) continue;
                if (!STORE_TMA || n_tiles == 0) {
                    unsigned short* orow = o + (row_base + q_idx) * HEAD_DIM;
#pragma unroll
                    for (int i = 0; i < HEAD_DIM / 8; ++i) {
                        const int d = 8 * i + 2 * (lane % 4);
                        *reinterpret_cast<unsigned*>(orow + d) = pack_bf16(O[4 * i + 2 * h] * inv_l[h], O[4 * i + 2 * h + 1] * inv_l[h]);
                    }
                }
                if (lane % 4 == 0)
                    lse[row_base + q_idx] = lsum == 0.0f ? -FAGEN_INFINITY : (m[h] + __log2f(lsum)) * 0.6931471805599453f;
            }
        }
#if STORE_TMA
        if (warp_in_wg == 0 && lane == 0) bulk_wait_all();         // stores complete before the CTA's shared memory goes
#endif
    }
}
