"""Per-item cost of Serve streaming: c streams of n items each, against one stream of n items of c entries."""
import asyncio, os, sys, time, resource
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "1.0")
import ray
from ray import serve

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 1})
class Echo:
    async def generate(self, n: int, width: int):
        for i in range(n):
            await asyncio.sleep(0)
            yield [(i, k, "tok", 0.0) for k in range(width)]

@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, echo):
        self.h = echo.options(stream=True, method_name="generate")
    async def measure(self, n: int, conc: int, width: int) -> float:
        async def one():
            async for b in self.h.remote(n, width):
                pass
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(conc)))
        return time.perf_counter() - t0

ray.init(num_cpus=2, include_dashboard=False)
serve.run(Caller.bind(Echo.bind()), name="cost", route_prefix=None)
async def driver():
    h = serve.get_app_handle("cost")
    await h.measure.remote(50, 1, 1)
    for rnd in range(2):
        t = await h.measure.remote(2000, 8, 1)
        print(f"8 streams x 2000 items of 1: {t:.2f} s, {16000/t:.0f} items/s, {2000/t:.0f} steps/s")
        t = await h.measure.remote(2000, 1, 8)
        print(f"1 stream x 2000 items of 8:  {t:.2f} s, {2000/t:.0f} items/s = steps/s")
asyncio.run(driver())
try: serve.shutdown()
except RuntimeError: pass
ray.shutdown()
