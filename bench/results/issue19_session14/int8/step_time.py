"""The engine step in process, one thread, batches 1, 2 and 8 decoding after a 200-token prompt: the median of
120 steps in the process's CPU time, per weight format (run from the repository root)."""
import statistics, sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))  # the repository
from model.checkpoint import load_model, load_tokenizer
from model.sampling import SamplingParams
from server.engine import Engine
ck = "checkpoints/shakespeare-small"  # run from the repository root
for quant, dtype in (("int8", torch.float32), (None, torch.bfloat16), (None, torch.float32), ("int8", torch.float32)):
    model = load_model(ck, device="cpu", dtype=dtype, kernels="auto", quantization=quant)
    engine = Engine(model, load_tokenizer(ck), threads=1, max_num_seqs=64)
    for B in (1, 2, 8):
        prompt = [(17 * i) % 5000 + 1 for i in range(200)]
        params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
        sinks = [[] for _ in range(B)]
        for i, s in enumerate(sinks):
            engine.submit(prompt[i:] + prompt[:i], params, s.append, use_cache=True)
        while any(not s for s in sinks):
            engine.step()
        ts = []
        for _ in range(120):
            t = time.process_time(); engine.step(); ts.append(time.process_time() - t)
        while engine.num_running or engine.num_waiting:
            engine.step()
        print(quant, dtype, B, "%.3f ms" % (1e3 * statistics.median(ts)), flush=True)
