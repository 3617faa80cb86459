"""Per-step time at batch B (decode-only, default checkpoint), in process: `python steptime_in_process.py CKPT [SPIN_US]`
(a fixed spin, the engine's policy off)."""
import sys, time, statistics
from pathlib import Path
from model.sampling import SamplingParams
from server.engine import Engine, EngineArgs
from server.engine.config import EngineConfig
from model import kernels
ck = Path(sys.argv[1]); spin_fixed = sys.argv[2] if len(sys.argv) > 2 else None
eng = Engine.from_args(EngineArgs(checkpoint=ck, config=EngineConfig(kv_cache_memory=256*2**20)))
if spin_fixed is not None:
    eng.kernel_spin.observe = lambda *a: None; kernels.set_spin_us(int(spin_fixed))
tok = eng.tokenizer
for B in (1, 2, 4, 8, 16, 32):
    evs = [[] for _ in range(B)]
    for i in range(B):
        eng.submit(tok.encode("To be or not to be, that is the question %d" % i), SamplingParams(max_new_tokens=96, temperature=0, ignore_eos=True), evs[i].append)
    times = []
    while not all(e and e[-1].finished for e in evs):
        t = time.perf_counter(); eng.step(); times.append(time.perf_counter() - t)
    print(f"B={B} step median {1000*statistics.median(times[5:]):.3f} ms  spin now {kernels.spin_us()}")
