import sys, time, json, socket, statistics, asyncio
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository
from pathlib import Path
import httpx
from bench.serving import running_server
from loadtest.prompts import load_prompts
CK = "checkpoints/shakespeare-small"
prompts, note = load_prompts(64, 8, None, CK, seed=0, shared_prefix_tokens=256, tenants=8)
def raw(host, port, body):
    data = json.dumps(body).encode()
    req = (f"POST /generate_stream HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
    s = socket.create_connection((host, port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter(); s.sendall(req); buf = b""; first = None; hdr = None
    while True:
        chunk = s.recv(65536)
        if not chunk: break
        now = time.perf_counter()
        buf += chunk
        if hdr is None and b"\r\n\r\n" in buf: hdr = now - t0
        if first is None and b"data:" in buf: first = now - t0
        if b'"details"' in buf and buf.endswith(b"\r\n0\r\n\r\n"): break
        if b"0\r\n\r\n" in buf[-7:]: break
    s.close()
    txt = buf.decode(errors="replace")
    det = [json.loads(l[5:]) for l in txt.split("\n") if l.startswith("data:") and '"details"' in l]
    d = det[-1]["details"] if det else {}
    return hdr * 1000, first * 1000, 1000 * d.get("time_to_first_token_s", 0), d.get("cached_tokens", 0)
with running_server(CK, "cpu", "float32", Path(__import__("tempfile").gettempdir()) / "direct.log", ["--threads", "1", "--kv-cache-memory", "20MiB"] + sys.argv[1:]) as url:
    host, port = url[7:].split(":"); port = int(port)
    for p in prompts[:16]: raw(host, port, {"inputs": p, "parameters": {"max_new_tokens": 4, "details": True}})
    R = []
    for p in prompts:
        R.append(raw(host, port, {"inputs": p, "parameters": {"max_new_tokens": 32, "details": True, "ignore_eos": True}})); time.sleep(0.05)
    print("raw socket: headers p50 %.2f first data p50 %.2f engine ttft p50 %.2f" % tuple(statistics.median(r[i] for r in R) for i in range(3)))
    H = []
    with httpx.Client(trust_env=False, timeout=60) as c:
        for p in prompts:
            t0 = time.perf_counter(); first = None
            with c.stream("POST", url + "/generate_stream", json={"inputs": p, "parameters": {"max_new_tokens": 32, "details": True, "ignore_eos": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and first is None: first = time.perf_counter() - t0
            H.append(first * 1000); time.sleep(0.05)
    print("httpx sync: first data p50 %.2f" % statistics.median(H))
