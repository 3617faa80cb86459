import sys, time, statistics, threading, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from pathlib import Path
from server.engine import Engine, EngineArgs, EngineConfig
from server.engine import engine as engmod, model_runner as mr, scheduler as sc
from model.sampling import SamplingParams
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"  # run from the repository root
prompts, _ = load_prompts(128, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
T = collections.defaultdict(list)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[cls.__name__ + "." + name].append(time.perf_counter() - t); return r
    setattr(cls, name, g)
for cls, name in [(mr.ModelRunner, "prepare"), (mr.ModelRunner, "execute"), (sc.Scheduler, "schedule"), (engmod.Engine, "_update"), (engmod.Engine, "_deliver"), (engmod.Engine, "step")]:
    wrap(cls, name)
import model.gpt as g
wrap(g.GPT, "forward_step"); wrap(g.GPT, "compute_logits")
eng = Engine.from_args(EngineArgs(checkpoint=Path(CK), device="cpu", dtype="float32", config=EngineConfig(threads=1))).start()
eng.warmup()
tok = eng.tokenizer
for p in prompts: # warm the cache
    done = threading.Event()
    eng.submit(tok.encode(p), SamplingParams(max_new_tokens=1, temperature=0), lambda o: o.finished and done.set()); done.wait()
T.clear(); firsts = []; subs = []
for p in prompts:
    ids = tok.encode(p)
    done = threading.Event(); first = []
    t0 = time.perf_counter()
    def sink(out):
        if not first: first.append(time.perf_counter() - t0)
        if out.finished: done.set()
    eng.submit(ids, SamplingParams(max_new_tokens=1, temperature=0), sink)
    subs.append(time.perf_counter() - t0)
    done.wait(); firsts.append(first[0])
print("first token ms p50 %.3f ; submit() %.3f" % (1000 * statistics.median(firsts), 1000 * statistics.median(subs)))
for k, v in T.items(): print("%-30s n=%d p50 %.3f ms" % (k, len(v), 1000 * statistics.median(v)))
eng.shutdown()
