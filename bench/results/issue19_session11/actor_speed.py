"""Engine speed alone: in this process, and in a Ray actor (num_cpus=1), same config, no HTTP."""
import os, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from server.engine import Engine, EngineArgs
from server.engine.config import EngineConfig
from model.sampling import SamplingParams

def run(n=3):
    e = Engine.from_args(EngineArgs(checkpoint=Path("checkpoints/shakespeare-small"), device="cpu",
                                    config=EngineConfig(threads=1))).start()
    e.warmup()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        evs = e.generate(list(range(5, 69)), SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        out.append((time.perf_counter() - t) / len(evs) * 1000)
    e.shutdown()
    return out, os.getpriority(os.PRIO_PROCESS, 0), os.environ.get("OMP_NUM_THREADS")

if __name__ == "__main__":
    print("here", run())
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    f = ray.remote(num_cpus=1)(run)
    print("ray task", ray.get(f.remote()))
    print("here again", run())
