"""NVRTC wall time: alone, two at once in threads, and beside a busy Python thread."""
import sys, time, threading, os
from fagen.backend import nvrtc
src = open(sys.argv[1]).read()
opts = ("--gpu-architecture=sm_90a", "--std=c++17")
def one():
    t = time.perf_counter(); nvrtc.compile_program(src, "k.cu", opts); return time.perf_counter() - t
one()
print("alone", [round(one(), 3) for _ in range(3)])
res = []
ths = [threading.Thread(target=lambda: res.append(one())) for _ in range(2)]
t = time.perf_counter(); [x.start() for x in ths]; [x.join() for x in ths]
print("two threads", [round(r, 3) for r in res], "wall", round(time.perf_counter() - t, 3))
stop = False
def busy():
    x = 0
    while not stop: x += 1
b = threading.Thread(target=busy); b.start()
print("beside busy python", round(one(), 3)); stop = True; b.join()
print("sched_getaffinity", len(os.sched_getaffinity(0)))
for f in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
    try: print(f, open(f).read().strip())
    except OSError: pass
