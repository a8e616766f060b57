import sys, time, statistics, re, subprocess, os
from fagen.backend import nvrtc
opts = ("--gpu-architecture=sm_90a", "--std=c++17", "--ptxas-options=--verbose")
for f in sorted(os.listdir(sys.argv[1])):
    row = [f[10:60]]
    for tree in sys.argv[1:]:
        src = open(os.path.join(tree, f)).read()
        ts = []
        for _ in range(int(os.environ.get("REP", 3))):
            t = time.perf_counter(); out, log = nvrtc.compile_program(src, "k.cu", opts); ts.append(time.perf_counter() - t)
        open('/tmp/o.cubin','wb').write(out)
        sass = subprocess.run(['cuobjdump','-sass','/tmp/o.cubin'],capture_output=True,text=True).stdout
        n = len(re.findall(r'/\*[0-9a-f]{4}\*/', sass))
        regs = re.findall(r'Used (\d+) registers', log); st = re.findall(r'(\d+) bytes stack frame', log)
        warn = len(re.findall(r'C75\d\d', log))
        row.append(f"{statistics.median(ts):.3f}s sass={n} r={regs} st={st} w={warn}")
    print(" | ".join(row))
