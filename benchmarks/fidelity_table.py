"""Print the Markdown table of a fidelity results file (benchmarks/results/fidelity_<model>.json)."""
import json
import sys
from pathlib import Path

path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "fidelity_smollm2.json")
runs = json.loads(path.read_text())["runs"]
for name, r in runs.items():
    print(f"| {name} | {r['top1_agreement']:.3f} | {r['mean_kl']:.4f} | {r['greedy_match_rate']:.2f} |")
