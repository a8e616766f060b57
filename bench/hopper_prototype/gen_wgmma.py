"""Writes the wgmma helper block of fa3_fwd.cu (between the GENERATED markers), one specialisation per N.

Each wgmma shape needs its own asm string with N/2 accumulator operands, so they are generated, not typed.
Run: python gen_wgmma.py  (rewrites fa3_fwd.cu in place).
"""
import pathlib
import re

NS = [64, 80, 96, 112, 128, 144, 160, 176, 192, 256]


def spec(n: int) -> str:
    r = n // 2
    acc = ", ".join(f"%{i}" for i in range(r))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    ss = (
        f"    // d (+)= A * B, A = 64x16 and B = 16x{n} both K-major in shared memory (descriptors)\n"
        f"    static __device__ __forceinline__ void ss(float (&d)[{r}], unsigned long long da, unsigned long long db, int accumulate) {{\n"
        f'        asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{r + 2}, 0;\\n"\n'
        f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{acc}}}, %{r}, %{r + 1}, p, 1, 1, 0, 0; }}"\n'
        f'            : {outs}\n'
        f'            : "l"(da), "l"(db), "r"(accumulate));\n'
        f"    }}\n"
    )
    rs = (
        f"    // d += A * B, A = 64x16 bf16 from registers (mma.sync A-fragment layout), B = 16x{n} MN-major (transposed)\n"
        f"    static __device__ __forceinline__ void rs(float (&d)[{r}], const unsigned (&a)[4], unsigned long long db, int accumulate) {{\n"
        f'        asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{r + 5}, 0;\\n"\n'
        f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{acc}}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, 1; }}"\n'
        f'            : {outs}\n'
        f'            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));\n'
        f"    }}\n"
    )
    return f"template <> struct Wgmma<{n}> {{\n{ss}{rs}}};\n"


def block() -> str:
    body = "template <int N> struct Wgmma;   // m64nNk16 bf16 -> f32 wgmma, one specialisation per N\n"
    body += "".join(spec(n) for n in NS)
    return "// BEGIN GENERATED WGMMA (gen_wgmma.py)\n" + body + "// END GENERATED WGMMA\n"


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("fa3_fwd.cu")
    text = path.read_text()
    text = re.sub(r"// BEGIN GENERATED WGMMA.*?// END GENERATED WGMMA\n", lambda _: block(), text, flags=re.S)
    path.write_text(text)
