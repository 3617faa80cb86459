"""Ray / direct figures of `bench.cluster overhead` JSON files: python3 ratios.py "DIR/overhead_*.json"."""
import json,glob,sys
for f in sorted(glob.glob(sys.argv[1])):
    d=json.load(open(f)); R=d['rounds']
    row=[]
    for i,c in enumerate(['c=1','c=8']):
        a=R['ray'][0][i]; b=R['direct'][0][i]
        row.append(f"{c} {a['tokens_per_s']:.0f}/{b['tokens_per_s']:.0f}={a['tokens_per_s']/b['tokens_per_s']:.2f} itl50 {a['itl_p50_ms']-b['itl_p50_ms']:+.2f} itl99 {a['itl_p99_ms']:.1f}/{b['itl_p99_ms']:.1f} ttft {a['ttft_p50_ms']:.1f}/{b['ttft_p50_ms']:.1f}")
    print(f.split('/')[-1], ' | '.join(row))
