"""One line per Baton configuration of a ``bench_gpu_engine.py --output-json`` file, for the
device A/B scripts: ``python benchmarks/device/ab_summary.py FILE.json VARIANT [NOTE]`` (NOTE
is appended to each line)."""

import json
import sys
from pathlib import Path

results = json.loads(Path(sys.argv[1]).read_text())
for section, error in results.get("errors", {}).items():
    print(f"{sys.argv[2]:8} {section} failed: {error}")
for r in results["throughput"]:
    if r["engine"] != "baton":
        continue
    graph = r["graph_replay_ms"]
    print(
        f"{sys.argv[2]:8} {r['shape']:6} batch {r['batch']:3} tok/s {r['output_tok_s']:9.1f}"
        f"  step ms {r['median_decode_step_ms']:.3f}"
        f"  graph ms {'-' if graph is None else f'{graph:.3f}'}"
        f"  prompt s {r.get('prompt_steps_s', 0):.3f}  decode s {r.get('decode_steps_s', 0):.3f}"
        + (f"  blocks {r['num_blocks']}" if r.get("num_blocks") else "")
        + (f"  {sys.argv[3]}" if len(sys.argv) > 3 and sys.argv[3] else "")
    )
